"""The LM head of a packed bf16 CPU model at <= 8 rows: fp32 logits straight from the C dots
(no bf16 rounding, no top-k recompute), the same bits for a row whatever the rows beside it."""
from __future__ import annotations

import pytest
import torch

from deepinfer.runtime.cpu_linear_packing import pack_linear_weights
from deepinfer.runtime.cpu_small_batch_linear import MAX_ROWS, SmallBatchLinear, load_small_batch_linear
from deepinfer.runtime.model_source import load_model, resolve_model
from tests.integration.tiny_models import tiny_hf_model


@pytest.fixture(scope="module")
def packed_models(tmp_path_factory):
    """Tied (the embedding table is the head) and untied heads, packed with the C kernel."""
    load_small_batch_linear.cache_clear()
    if load_small_batch_linear() is None:
        pytest.fail("the C compiler is part of the supported setup; the small-batch kernel failed")
    out = {}
    for i, kind in enumerate(("llama_tied", "llama")):
        directory = tmp_path_factory.mktemp(kind)
        tiny_hf_model(kind, seed=30 + i).save_pretrained(directory)
        model = load_model(resolve_model(str(directory)), torch.bfloat16)
        assert pack_linear_weights(model) > 0
        out[kind] = model
    return out


def _head_weight(model) -> torch.Tensor:
    return model.model.embed_tokens.weight if model.lm_head is None else model._plain_lm_head[0].weight


@pytest.mark.parametrize("kind", ["llama_tied", "llama"])
def test_small_batch_logits_are_fp32_everywhere_not_only_the_top(packed_models, kind):
    model = packed_models[kind]
    exact_weight = _head_weight(model).float()
    gen = torch.Generator().manual_seed(1)
    for rows in (1, 2, 5, MAX_ROWS):
        hidden = (torch.randn(rows, model.config.hidden_size, generator=gen) * 3).bfloat16()
        exact = hidden.float() @ exact_weight.T
        logits = model.compute_logits(hidden)
        assert logits.dtype == torch.float32 and logits.shape == exact.shape
        # fp32 sums in another order; a bf16-rounded tail would be off by up to ~1e-2
        assert torch.allclose(logits, exact, atol=1e-4, rtol=0), (rows, (logits - exact).abs().max())
        assert torch.equal(logits.argmax(-1), exact.argmax(-1))


@pytest.mark.parametrize("kind", ["llama_tied", "llama"])
def test_a_row_has_the_same_logits_alone_or_among_up_to_8_rows(packed_models, kind):
    """Speculative verification computes the logits of several positions in one call; each must
    equal that position's logits decoded alone, bit for bit (spec == plain under sampling)."""
    model = packed_models[kind]
    gen = torch.Generator().manual_seed(2)
    hidden = (torch.randn(MAX_ROWS, model.config.hidden_size, generator=gen) * 3).bfloat16()
    alone = torch.cat([model.compute_logits(hidden[i:i + 1]) for i in range(MAX_ROWS)])
    for rows in range(2, MAX_ROWS + 1):
        assert torch.equal(model.compute_logits(hidden[:rows]), alone[:rows]), rows


def test_more_rows_keep_the_rounded_matmul_and_exact_top(packed_models):
    model = packed_models["llama_tied"]
    gen = torch.Generator().manual_seed(3)
    hidden = (torch.randn(MAX_ROWS + 3, model.config.hidden_size, generator=gen) * 3).bfloat16()
    exact = hidden.float() @ _head_weight(model).float().T
    logits = model.compute_logits(hidden)
    top = exact.topk(4, dim=-1).indices
    assert torch.allclose(logits.gather(1, top), exact.gather(1, top), atol=1e-4, rtol=0)
    head = model.logits_linear if model.logits_linear is not None else model.lm_head
    if getattr(head, "packed_weight", None) is not None:
        assert (logits - exact).abs().max() > 1e-3  # the tail is bf16-rounded on this path
    else:  # no packed weight (AVX2): the kernel's fp32 dots in calls of MAX_ROWS rows
        assert torch.allclose(logits, exact, atol=1e-4, rtol=0)
        alone = torch.cat([model.compute_logits(hidden[i:i + 1]) for i in range(hidden.shape[0])])
        assert torch.equal(logits, alone)


@pytest.mark.parametrize("num_threads", [1, 2])
def test_fp32_dots_of_a_row_do_not_depend_on_the_row_count(num_threads):
    """The kernel entry the head uses, at the default model's head shape (49152 x 576)."""
    kernel = load_small_batch_linear()
    assert isinstance(kernel, SmallBatchLinear)
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        gen = torch.Generator().manual_seed(num_threads)
        weight = (torch.randn(49152, 576, generator=gen) / 24).bfloat16()
        x = torch.randn(MAX_ROWS, 576, generator=gen).bfloat16()
        alone = torch.cat([kernel.dots_f32(x[i:i + 1], weight) for i in range(MAX_ROWS)])
        assert torch.allclose(alone, x.float() @ weight.float().T, atol=1e-4, rtol=0)
        for rows in range(2, MAX_ROWS + 1):
            assert torch.equal(kernel.dots_f32(x[:rows], weight), alone[:rows]), rows
    finally:
        torch.set_num_threads(previous)
