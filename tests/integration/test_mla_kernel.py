"""The C MLA decode kernel (runtime/cpu_mla_kernel.py) against the torch absorbed path of
`PagedMLAAttention._decode` (gather + `mla_absorbed`) and a float64 reference, and a tiny
random DeepSeek-V3 whose decode runs on it: float32 greedy tokens equal the torch path's and
transformers'; bf16 ones equal the torch path's up to the first near-tie.

Tolerances. float32: kernel and SDPA sum the same float32 products in other orders; against
float64 the kernel is off by float32 rounding of sums of terms of size |o| ~ 1..5 here, ~1e-6,
so 1e-5 absolute + relative leaves a 3x margin and is still 1000x below a wrong answer
(a head off by one entry moves values by ~1e-1). bf16: the kernel's float32 result is rounded
once to bf16, at most half a step, 2^-8 relative, from the float64 one (plus the float32
noise); the torch path rounds once too, so the two sit within one step, 2^-7 relative, of
each other (the same bound as the load-time self-test).
"""
from __future__ import annotations

import pytest
import torch

from deepinfer.layers.mla import MLAWeights
from deepinfer.runtime import cpu_mla_kernel
from deepinfer.runtime.cpu_kernel_build import kernels_enabled
from deepinfer.runtime.cpu_mla_kernel import random_case, reference_mla_decode
from deepinfer.runtime.mla_attention import PagedMLAAttention
from deepinfer.runtime.paged_attention import AttentionMetadata, DecodeMetadata

pytestmark = pytest.mark.timeout(600)
# Two bf16 runs whose attention differs by a bf16 step (kernel vs torch path) move the logits
# by bf16 noise of the stack, 2^-8 of logits of a few units: ~0.02; a reference top-2 gap
# below this is a near-tie either run may break its own way.
BF16_PAIR_GAP = 0.1


@pytest.fixture(scope="module")
def kernel():
    if not kernels_enabled():
        pytest.skip("DEEPINFER_CPU_KERNELS=0")
    loaded = cpu_mla_kernel.load_mla_kernel()
    assert loaded is not None, "the MLA kernel did not build or failed its self-test here"
    assert loaded.supports(torch.bfloat16, torch.device("cpu"))
    assert loaded.supports(torch.float32, torch.device("cpu"))
    return loaded


# (heads, rank, rope, block size, lens): DeepSeek's r=512 rope=64 at H=16 and 128, lengths 1,
# on and one past block boundaries, ragged in one batch; a tiny shape with odd widths.
CASES = [
    (16, 512, 64, 16, [1]),
    (16, 512, 64, 16, [16, 17, 1, 320]),
    (128, 512, 64, 16, [33, 1, 48]),
    (128, 512, 64, 16, [1]),
    (4, 24, 8, 4, [1, 2, 3, 4, 5, 8, 9, 31]),
    (3, 13, 3, 1, [7, 1]),
]


def _ids(case):
    return f"H{case[0]}-r{case[1]}-rope{case[2]}-bs{case[3]}-B{len(case[4])}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=_ids)
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_matches_float64_reference(kernel, case, dtype, threads):
    heads, rank, rope, block_size, lens = case
    gen = torch.Generator().manual_seed(hash((heads, rank, len(lens))) % 1000)
    query, entries, tables, lens_t, scale = random_case(heads, rank, rope, block_size, lens,
                                                        dtype, gen)
    want = reference_mla_decode(query.double(), entries.double(), tables, lens_t, rank, scale)
    got = kernel(query, entries, tables, lens_t, rank, scale, threads)
    assert got.dtype == dtype and got.shape == (len(lens), heads, rank)
    rtol, atol = (1e-5, 1e-5) if dtype == torch.float32 else (2 ** -8 + 1e-5, 1e-5)
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol)


def _decode_out(entries, query_parts, tables, lens, weights, mla_kernel):
    """`PagedMLAAttention._decode` on one step of decodes -> [B, H, v]."""
    q_nope, q_pe = query_parts
    num = q_nope.shape[0]
    width = tables.shape[1]
    ctx = torch.arange(width * entries.shape[1])
    mask = None if mla_kernel else (ctx[None] < lens[:, None])[:, None, None, :]
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long),
                             DecodeMetadata(num, tables.reshape(-1), mask, lens), [])
    out = q_nope.new_empty(num, q_nope.shape[1], weights.w_uv.shape[1])
    PagedMLAAttention(None, meta, mla_kernel)._decode(q_nope, q_pe, entries, weights, out)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_decode_with_kernel_matches_torch_absorbed_path(kernel, case, dtype):
    """Through `_decode` (absorb_query, the kernel or gather + mla_absorbed, W_UV): the same
    attention output within the bounds above, carried through W_UV (|W_UV| |o| per value)."""
    heads, rank, rope, block_size, lens = case
    nope, v_dim = 16, 24
    gen = torch.Generator().manual_seed(len(lens) + heads)
    _, entries, tables, lens_t, _ = random_case(heads, rank, rope, block_size, lens, dtype, gen)
    scale = (nope + rope) ** -0.5
    w_uk = (torch.randn(heads, nope, rank, generator=gen) * rank ** -0.5).to(dtype)
    w_uv = (torch.randn(heads, v_dim, rank, generator=gen) * rank ** -0.5).to(dtype)
    weights = MLAWeights(w_uk, w_uv, scale)
    q_nope = (3 * torch.randn(len(lens), heads, nope, generator=gen)).to(dtype)
    q_pe = (3 * torch.randn(len(lens), heads, rope, generator=gen)).to(dtype)
    got = _decode_out(entries, (q_nope, q_pe), tables, lens_t, weights, kernel)
    want = _decode_out(entries, (q_nope, q_pe), tables, lens_t, weights, None)
    # Size of what the einsum sums per output value: an o_latent error of e relative gives at
    # most e * (|W_UV| @ |o_latent|) there; bf16 adds the final rounding of both.
    o_abs = reference_mla_decode(
        torch.cat((torch.einsum("bhn,hnr->bhr", q_nope.double(), w_uk.double()), q_pe.double()), -1),
        entries.double(), tables, lens_t, rank, scale).abs()
    scale_of = torch.einsum("bhr,hvr->bhv", o_abs, w_uv.double().abs())
    rel = 1e-5 if dtype == torch.float32 else 2 ** -7
    bound = rel * scale_of + (2 ** -7 * want.double().abs() if dtype == torch.bfloat16 else 0) + 1e-6
    err = (got.double() - want.double()).abs()
    assert bool((err <= bound).all()), f"max error {err.max():.3g}, worst ratio {(err / bound).max():.3g}"


def test_kernel_reads_only_the_table_and_lengths(kernel):
    """Entries past a sequence's length and blocks outside its table do not change its output
    (they are garbage in a real cache: other sequences' rows, stale rows)."""
    gen = torch.Generator().manual_seed(3)
    query, entries, tables, lens, scale = random_case(16, 512, 64, 16, [5, 20], torch.bfloat16, gen)
    before = kernel(query, entries, tables, lens, 512, scale)
    used = set(tables[0, :1].tolist()) | set(tables[1, :2].tolist())
    poisoned = entries.clone()
    for blk in range(entries.shape[0]):
        if blk not in used:
            poisoned[blk] = 1e4
    poisoned[tables[0, 0], 5:] = 1e4
    poisoned[tables[1, 1], 4:] = 1e4
    assert torch.equal(kernel(query, poisoned, tables, lens, 512, scale), before)


def test_self_test_catches_a_wrong_kernel(kernel, monkeypatch):
    """A kernel off by one token of context fails the load-time check."""
    call = cpu_mla_kernel.MLADecodeKernel.__call__
    monkeypatch.setattr(cpu_mla_kernel.MLADecodeKernel, "__call__",
                        lambda self, q, e, t, lens, *a: call(self, q, e, t, (lens - 1).clamp_min(1), *a))
    assert cpu_mla_kernel.kernel_mismatch(kernel, torch.bfloat16) is not None
    assert cpu_mla_kernel.kernel_mismatch(kernel, torch.float32) is not None


def test_env_switch_turns_the_kernel_off(monkeypatch):
    monkeypatch.setenv("DEEPINFER_MLA_KERNEL", "0")
    assert cpu_mla_kernel.load_mla_kernel() is None


# ---- a whole model -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def deepseek(tmp_path_factory, default_model_source):
    """(transformers fp32 model, checkpoint dir) of a tiny random DeepSeek-V3."""
    from tests.integration.moe_checkpoints import tiny_moe_model

    model = tiny_moe_model("deepseek_v3", seed=71)
    directory = tmp_path_factory.mktemp("mla_kernel_deepseek_v3")
    model.save_pretrained(directory)
    default_model_source.load_tokenizer().save_pretrained(directory)
    return model.eval(), str(directory)


def _generate(llm, prompts, max_tokens):
    from deepinfer import SamplingParams
    from tests.integration.engine_checks import generate_checked, token_prompts

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in generate_checked(llm, token_prompts(prompts), params)]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_deepseek_decode_on_kernel_equals_torch_path_and_reference(kernel, deepseek, dtype, monkeypatch):
    from deepinfer import LLM
    from tests.integration.moe_checkpoints import random_prompts
    from tests.integration.test_moe_engine_reference import TinyReference

    reference, directory = deepseek
    # block size 4: prompts and decodes cross many block boundaries
    llm = LLM(model=directory, dtype=dtype, seed=0, kv_cache_memory="32MiB", block_size=4)
    runner = llm.engine.runner
    assert runner.mla_kernel is not None, "the latent cache's runner runs the kernel"
    calls = []
    real = runner.mla_kernel
    runner.mla_kernel = lambda *a: calls.append(1) or real(*a)
    runner.mla_kernel.supports = real.supports
    prompts = random_prompts(seed=17, lengths=(2, 9, 33, 5, 17, 3, 1, 12))
    with_kernel = _generate(llm, prompts, 12)  # 8 concurrent decodes
    num_layers = reference.config.num_hidden_layers
    assert len(calls) >= 11 * num_layers, "decode steps ran on the kernel"
    runner.mla_kernel = None
    without = _generate(llm, prompts, 12)
    ref = TinyReference(reference)
    num_checked = 0
    for prompt, tokens, plain in zip(prompts, with_kernel, without):
        trace = ref.score(prompt, tokens)  # the reference is fed the engine's own tokens
        if dtype == "float32":  # transformers' fp32 tokens wherever they are not a near-tie
            for step, (got, want) in enumerate(zip(tokens, trace.greedy_token_ids)):
                if trace.top2_gaps[step] >= 1e-3:
                    assert got == want, f"step {step} of a {len(prompt)}-token prompt"
                    num_checked += 1
            assert plain == tokens, f"kernel and torch path differ, {len(prompt)}-token prompt"
        else:
            # bf16 itself strays from the fp32 reference (this model's torch path picks another
            # token at a top-2 gap of ~1), so the reference is the torch path: the same tokens
            # up to the first near-tie, where a bf16 step of difference may pick the other one.
            ties = [i for i, g in enumerate(trace.top2_gaps) if g < BF16_PAIR_GAP]
            same = ties[0] + 1 if ties else len(tokens)
            assert plain[:same] == tokens[:same], f"kernel and torch path differ, {len(prompt)}-token prompt"
            num_checked += same
    assert num_checked >= 40, "too few decisive tokens to compare"
