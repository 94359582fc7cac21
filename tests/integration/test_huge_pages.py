"""Weights moved onto transparent huge pages (runtime/cpu_huge_pages.py): same values, aligned,
aliases taken after the move share it, and a packed model computes the same bits."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepinfer.runtime import cpu_huge_pages
from deepinfer.runtime.cpu_huge_pages import HUGE_PAGE, huge_page_bytes, move_to_huge_pages
from deepinfer.runtime.cpu_linear_packing import pack_linear_weights
from deepinfer.runtime.cpu_small_batch_linear import load_small_batch_linear
from deepinfer.runtime.model_source import load_model, resolve_model
from tests.integration.tiny_models import tiny_hf_model


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "unknown"
    return text.split("[")[1].split("]")[0]


def test_moved_tensors_keep_values_and_share_one_aligned_arena(monkeypatch):
    monkeypatch.setenv("DEEPINFER_HUGE_PAGES", "1")
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(1024, 1536, generator=gen).bfloat16() for _ in range(4)]  # 12 MiB
    before = [t.clone() for t in tensors]
    huge_before = huge_page_bytes()
    moved = move_to_huge_pages([*tensors, tensors[2]])  # one tensor twice: moved once
    assert moved == 4 * 1024 * 1536 * 2
    assert tensors[0].data_ptr() % HUGE_PAGE == 0
    assert all(t.data_ptr() % 4096 == 0 for t in tensors)
    for t, b in zip(tensors, before):
        assert torch.equal(t, b)
    tensors[1].zero_()  # writable, and independent of the old memory
    assert not torch.equal(tensors[1], before[1])
    if _thp_mode() in ("always", "madvise") and huge_before >= 0:
        # the advice took (huge pages can still run out, so some, not all)
        assert huge_page_bytes() - huge_before >= HUGE_PAGE


def test_switch_off_leaves_tensors_where_they_are(monkeypatch):
    monkeypatch.setenv("DEEPINFER_HUGE_PAGES", "0")
    t = torch.randn(256, 256).bfloat16()
    ptr = t.data_ptr()
    assert move_to_huge_pages([t]) == 0 and t.data_ptr() == ptr


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama_tied")
    tiny_hf_model("llama_tied", seed=5).save_pretrained(directory)
    return str(directory)


def _packed(checkpoint, monkeypatch, huge: bool):
    monkeypatch.setenv("DEEPINFER_HUGE_PAGES", "1" if huge else "0")
    model = load_model(resolve_model(checkpoint), torch.bfloat16)
    pack_linear_weights(model)
    return model


def test_packed_model_streams_its_plain_weights_from_the_arena_and_computes_the_same(checkpoint, monkeypatch):
    assert load_small_batch_linear() is not None
    huge, plain = _packed(checkpoint, monkeypatch, True), _packed(checkpoint, monkeypatch, False)
    gate_up = huge.model.layers[0].mlp.gate_up_proj
    # the small-batch kernel's copy is the moved weight (an alias taken after the move)
    assert gate_up.plain_weight.data_ptr() % 4096 == 0
    assert huge.logits_linear.plain_weight.data_ptr() == huge.model.embed_tokens.weight.data_ptr()
    ptrs = sorted(layer.mlp.gate_up_proj.plain_weight.data_ptr() for layer in huge.model.layers)
    assert ptrs[-1] - ptrs[0] < 2 * HUGE_PAGE  # one arena, not scattered allocations
    assert plain.model.layers[0].mlp.gate_up_proj.plain_weight.data_ptr() != gate_up.plain_weight.data_ptr()
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for rows in (1, 2, 11):
            x = torch.randn(rows, huge.config.hidden_size, generator=gen).bfloat16()
            assert torch.equal(gate_up(x), plain.model.layers[0].mlp.gate_up_proj(x)), rows
            assert torch.equal(huge.compute_logits(x), plain.compute_logits(x)), rows
            ids = torch.randint(0, huge.config.vocab_size, (rows,), generator=gen)
            assert torch.equal(huge.model.embed_tokens(ids), plain.model.embed_tokens(ids))


def test_an_unavailable_arena_keeps_the_weights(monkeypatch):
    monkeypatch.setenv("DEEPINFER_HUGE_PAGES", "1")

    def fail(nbytes):
        raise OSError("no memory")

    monkeypatch.setattr(cpu_huge_pages, "huge_page_arena", fail)
    t = torch.randn(64, 64).bfloat16()
    ptr = t.data_ptr()
    assert move_to_huge_pages([t]) == 0 and t.data_ptr() == ptr
