"""The bf16 CPU fast paths (packed / small-batch linears, fused norm, SiLU and rotary kernels,
the C paged decode kernel) against the plain torch model on the same paged steps.

Tiny random checkpoints cover a tied head, q/k/v biases and per-head q/k norms.
"""
from __future__ import annotations

import pytest
import torch

from deepinfer.core.scheduler_output import ScheduledRequest
from deepinfer.layers.mlp import SwiGLUMLP
from deepinfer.layers.norm import RMSNorm
from deepinfer.layers.rotary import apply_rotary
from deepinfer.models.llama import LlamaAttention
from deepinfer.runtime.cpu_elementwise_kernels import install_elementwise_kernels
from deepinfer.runtime.cpu_linear_packing import pack_linear_weights
from deepinfer.runtime.cpu_small_batch_linear import load_small_batch_linear
from deepinfer.runtime.kv_cache import KVCacheSpec, PagedKVCache
from deepinfer.runtime.model_runner import SHORT_CHUNK_TOKENS, ModelRunner
from deepinfer.runtime.model_source import load_model, resolve_model
from deepinfer.sampling_params import SamplingParams
from tests.integration.tiny_models import VOCAB, tiny_hf_model

KINDS = ["llama_tied", "qwen2", "qwen3"]
BLOCK = 4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for i, kind in enumerate(KINDS):
        directory = tmp_path_factory.mktemp(kind)
        tiny_hf_model(kind, seed=10 + i).save_pretrained(directory)
        out[kind] = str(directory)
    return out


def _fast_model(directory, monkeypatch):
    monkeypatch.setenv("DEEPINFER_SMALL_BATCH_LINEAR", "1")
    load_small_batch_linear.cache_clear()
    model = load_model(resolve_model(directory), torch.bfloat16)
    pack_linear_weights(model)
    install_elementwise_kernels(model)
    load_small_batch_linear.cache_clear()
    return model


def _runner(model, monkeypatch, decode_kernel: bool) -> ModelRunner:
    monkeypatch.setenv("DEEPINFER_DECODE_KERNEL", "1" if decode_kernel else "0")
    c = model.config
    spec = KVCacheSpec(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, BLOCK, torch.bfloat16)
    return ModelRunner(model, PagedKVCache(spec, 40, torch.device("cpu")), torch.device("cpu"))


def _step_logits(runner: ModelRunner, scheduled: list[ScheduledRequest]) -> torch.Tensor:
    """Logits of each request's last row [N, vocab], in the order of `scheduled`; the batch is
    laid out as ModelRunner.execute lays it out."""
    ordered = sorted(scheduled, key=lambda r: not runner._as_decode(r))
    with torch.inference_mode():
        ids, positions, meta, sample_idx, _ = runner._prepare(ordered)
        hidden = runner.model(ids, positions, runner._attention_backend(meta))
        logits = runner.model.compute_logits(hidden[sample_idx])
    return logits[[ordered.index(r) for r in scheduled]]


def _req(rid, tokens, computed, blocks):
    return ScheduledRequest(rid, tokens, computed, blocks, True, SamplingParams(temperature=0.0), 0)


def test_every_bf16_module_gets_its_kernel_after_packing(checkpoints, monkeypatch):
    """Packing turns the MLP's weights into buffers; the kernels must still be installed
    (they were not: the dtype was read from parameters only)."""
    model = _fast_model(checkpoints["qwen3"], monkeypatch)  # q/k norms inside attention too
    for cls in (RMSNorm, SwiGLUMLP, LlamaAttention):
        modules = [m for m in model.modules() if isinstance(m, cls)]
        assert modules and all(m.cpu_kernels is not None for m in modules), cls.__name__


def test_rotary_kernel_is_bit_equal_to_torch(checkpoints, monkeypatch):
    model = _fast_model(checkpoints["llama_tied"], monkeypatch)
    attn = model.model.layers[0].self_attn
    rope = model.model.rotary
    gen = torch.Generator().manual_seed(0)
    for num_tokens in (1, 5, 70):
        qkv = (4 * torch.randn(num_tokens, attn.q_size + 2 * attn.kv_size, generator=gen)).bfloat16()
        qk = qkv[:, :attn.q_size + attn.kv_size].view(num_tokens, -1, attn.head_dim)
        cos, sin = rope.cos_sin(torch.randint(0, 128, (num_tokens,), generator=gen))
        assert attn.cpu_kernels.rotary_applies(qk, cos, sin)
        assert torch.equal(attn._rotary(qk, cos, sin), apply_rotary(qk, cos, sin))


@pytest.mark.parametrize("kind", KINDS)
def test_fast_paths_match_plain_torch_on_paged_steps(checkpoints, kind, monkeypatch):
    plain = load_model(resolve_model(checkpoints[kind]), torch.bfloat16)
    fast = _fast_model(checkpoints[kind], monkeypatch)
    runners = {"plain": _runner(plain, monkeypatch, decode_kernel=False),
               "fast": _runner(fast, monkeypatch, decode_kernel=True)}
    assert runners["plain"].decode_kernel is None and runners["fast"].decode_kernel is not None
    assert runners["fast"]._as_decode(_req("a", [1] * SHORT_CHUNK_TOKENS, 9, []))
    assert not runners["fast"]._as_decode(_req("a", [1] * (SHORT_CHUNK_TOKENS + 1), 9, []))
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (13, 6, 30)]
    blocks = [list(range(1, 11)), list(range(11, 21)), list(range(21, 31))]
    # Prefill (a: a chunk of 9, then 4 more after that prefix, as a verification chunk would
    # be; c: a chunk longer than SHORT_CHUNK_TOKENS listed first, then 3 after its prefix);
    # then batch-2 and batch-1 decodes of a and b.
    steps = [[_req("c", prompts[2][:27], 0, blocks[2]), _req("a", prompts[0][:9], 0, blocks[0]),
              _req("b", prompts[1], 0, blocks[1])],
             [_req("c", prompts[2][27:], 27, blocks[2]), _req("a", prompts[0][9:], 9, blocks[0])]]
    lens = [13, 6]
    for step in steps:
        got = {name: _step_logits(r, step) for name, r in runners.items()}
        assert torch.allclose(got["fast"], got["plain"], atol=5e-2, rtol=5e-2)
    tokens = [got["plain"][1].argmax().item()]
    last_b = 0
    for i in range(6):
        batch = [_req("a", [tokens[-1]], lens[0], blocks[0])]
        if i < 3:  # batch of 2 (two-row linears), then batch of 1
            batch.append(_req("b", [last_b], lens[1], blocks[1]))
        got = {name: _step_logits(r, batch) for name, r in runners.items()}
        diff = (got["fast"] - got["plain"]).abs().max().item()
        assert torch.allclose(got["fast"], got["plain"], atol=5e-2, rtol=5e-2), diff
        tokens.append(got["plain"][0].argmax().item())
        lens[0] += 1
        if i < 3:
            last_b = got["plain"][1].argmax().item()
            lens[1] += 1


def test_short_chunk_after_a_prefill_chunk_stays_a_prefill_chunk(checkpoints, monkeypatch):
    """Decode rows lead the flat batch; an order that puts a long chunk first (the draft
    runner sorts on num_new_tokens != 1 alone) keeps the short chunk after it a prefill chunk."""
    runner = _runner(_fast_model(checkpoints["llama_tied"], monkeypatch), monkeypatch, True)
    long_chunk = _req("c", [5] * (SHORT_CHUNK_TOKENS + 1), 0, list(range(1, 11)))
    short = _req("a", [6] * 3, 4, list(range(11, 21)))
    meta = runner._prepare([long_chunk, short])[2]
    assert meta.decode is None and [c.num_tokens for c in meta.prefills] == [SHORT_CHUNK_TOKENS + 1, 3]
    meta = runner._prepare([short, long_chunk])[2]
    assert meta.decode.num_tokens == 3 and meta.decode.context_lens.tolist() == [5, 6, 7]
    assert [c.num_tokens for c in meta.prefills] == [SHORT_CHUNK_TOKENS + 1]
