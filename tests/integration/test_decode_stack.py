"""The fused decode stack (kernels/decode_stack.c) against the per-op path.

The stack runs the per-op path's kernels (small-batch GEMV, RMSNorm / SiLU / rotary, paged
decode attention) with the same roundings, so it must be bit-equal to that path wherever the
per-op path runs those kernels too. The per-op path sends linears of more than
cpu_linear_packing.SMALL_BATCH_ROWS rows to oneDNN, which rounds differently; the equality
tests raise that limit to the stack's 8 rows so every row count compares bit for bit. (The
self-test at load compares with the plain torch path within a tolerance, as does
test_cpu_fast_paths.)
"""
from __future__ import annotations

import shutil

import pytest
import torch

from deepinfer.runtime import cpu_decode_stack, cpu_kernel_build, cpu_linear_packing
from deepinfer.runtime.cpu_decode_kernel import load_decode_kernel
from deepinfer.runtime.cpu_decode_stack import (_clone_cache, _decode_step, _random_model,
                                                install_decode_stack)
from deepinfer.runtime.cpu_elementwise_kernels import install_elementwise_kernels
from deepinfer.runtime.paged_attention import AttentionMetadata, PagedAttention
from deepinfer.sampling_params import SamplingParams

# (hidden, heads, kv heads, head dim, intermediate, bias): MHA, GQA 2/3/4, head dims 16-128,
# q/k/v bias (Qwen2) on and off, intermediate sizes off the 256-wide SiLU chunk.
SHAPES = [(64, 4, 4, 16, 96, False), (192, 6, 2, 64, 520, True), (128, 4, 1, 64, 200, True),
          (256, 4, 2, 128, 300, False)]


def _host_has_vector_isa() -> bool:
    """AVX-512, or AVX2 with FMA: the instruction sets the stack's attention rows are built for."""
    flags = open("/proc/cpuinfo").read().split()
    return "avx512f" in flags or ("avx2" in flags and "fma" in flags)


@pytest.fixture(autouse=True)
def stack_builds_on_this_host(request):
    """The stack is AVX-512 or AVX2 + FMA code: on a host with neither the engine stays on the
    per-op path (checked by the switch-off tests, which run everywhere); on a host with one the
    build must load and pass its self-test."""
    if "no_avx512_needed" in request.keywords:
        return
    if cpu_decode_stack.load_decode_stack_library() is None:
        assert not _host_has_vector_isa(), "AVX-512 / AVX2 host: the decode stack must build and pass its self-test"
        pytest.skip("no AVX-512 or AVX2 + FMA on this host: the fused decode stack is off")


@pytest.fixture
def gemv_for_every_row(monkeypatch):
    """The per-op path's linears use the C GEMV up to 8 rows (as the stack does)."""
    monkeypatch.setattr(cpu_linear_packing, "SMALL_BATCH_ROWS", cpu_decode_stack.MAX_ROWS)


def _fast_random_model(shape, seed):
    model = _random_model(*shape, torch.Generator().manual_seed(seed))
    cpu_linear_packing.pack_linear_weights(model)
    install_elementwise_kernels(model)  # installs the stack too
    return model


def _counting(stack) -> list[int]:
    """The list the stack appends each step's row count to, emptied."""
    stack.rows_run = []
    return stack.rows_run


@pytest.mark.parametrize("shape", SHAPES)
def test_stack_is_bit_equal_to_the_per_op_kernels(shape, gemv_for_every_row):
    model = _fast_random_model(shape, seed=sum(shape))
    stack = model.model.decode_stack
    assert stack is not None
    calls = _counting(stack)
    kernel = load_decode_kernel()
    gen = torch.Generator().manual_seed(5)
    with torch.inference_mode():
        for rows in (1, 2, 3, 8):
            cache, meta, ids, positions = _decode_step(model, gen, rows)
            per_op_cache = _clone_cache(cache)
            model.model.decode_stack = None
            want = model.model(ids, positions, PagedAttention(per_op_cache, meta, shape[1], kernel))
            model.model.decode_stack = stack
            got = model.model(ids, positions, PagedAttention(cache, meta, shape[1], kernel))
            assert torch.equal(got, want), (rows, (got.float() - want.float()).abs().max().item())
            assert torch.equal(cache.kv, per_op_cache.kv), rows  # the K/V the step wrote
            assert torch.equal(model.compute_logits(got), model.compute_logits(want))
    assert calls == [1, 2, 3, 8]


def test_stack_takes_only_decode_only_steps_of_a_few_rows():
    shape = SHAPES[0]
    model = _fast_random_model(shape, seed=1)
    stack = model.model.decode_stack
    calls = _counting(stack)
    gen = torch.Generator().manual_seed(2)
    with torch.inference_mode():
        cache, meta, ids, positions = _decode_step(model, gen, 3)
        attn = PagedAttention(cache, meta, shape[1])
        assert stack.applies(ids, attn)
        embeds = model.model.embed_tokens(ids)
        model.model(ids, positions, attn, input_embeds=embeds)  # image rows: per-op path
        with_prefill = AttentionMetadata(meta.slot_mapping, meta.decode, [object()])
        assert not stack.applies(ids, PagedAttention(cache, with_prefill, shape[1]))
        assert not stack.applies(ids, PagedAttention(cache, AttentionMetadata(
            meta.slot_mapping, None, []), shape[1]))
        cache9, meta9, ids9, _ = _decode_step(model, gen, 9)
        assert not stack.applies(ids9, PagedAttention(cache9, meta9, shape[1]))  # > 8 rows
    assert calls == []


@pytest.mark.no_avx512_needed
def test_switch_off_keeps_the_per_op_path(monkeypatch):
    monkeypatch.setenv("DEEPINFER_DECODE_STACK", "0")
    model = _fast_random_model(SHAPES[0], seed=3)
    assert model.model.decode_stack is None
    assert not install_decode_stack(model)


@pytest.mark.no_avx512_needed
def test_q_k_norm_and_moe_models_keep_the_per_op_path():
    model = _random_model(*SHAPES[0], torch.Generator().manual_seed(4))
    cpu_linear_packing.pack_linear_weights(model)
    layer = model.model.layers[1].self_attn
    layer.q_norm = layer.k_norm = torch.nn.Identity()  # as a Qwen3 layer has them
    assert not install_decode_stack(model)
    assert model.model.decode_stack is None


def test_a_wrong_stack_build_is_not_used(tmp_path, monkeypatch, caplog):
    """A real build with one step broken (the o_proj residual add dropped) fails the self-test
    against torch and is never installed."""
    sources = tmp_path / "kernels"
    shutil.copytree(cpu_kernel_build.KERNEL_DIR, sources)
    path = sources / "decode_stack.c"
    text = path.read_text()
    old = "stack_gemv(&w_o, &in, o_b, hid, hid,"
    assert old in text, "update this test's fault"
    path.write_text(text.replace(old, "stack_gemv(&w_o, &in, o_b, NULL, hid,"))
    monkeypatch.setattr(cpu_kernel_build, "KERNEL_DIR", sources)
    monkeypatch.setattr(cpu_kernel_build, "_VERDICTS", {})
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cpu_decode_stack._verified_library.cache_clear()
    try:
        model = _random_model(*SHAPES[0], torch.Generator().manual_seed(4))
        cpu_linear_packing.pack_linear_weights(model)
        assert not install_decode_stack(model)
        assert model.model.decode_stack is None
        assert any("decode_stack_bf16" in r.getMessage() for r in caplog.records)
    finally:
        cpu_decode_stack._verified_library.cache_clear()


# --- the default model in bf16 through the engine -------------------------------------------

PROMPTS = ["def fibonacci(n):\n    ", "The capital of France is", "Once upon a time, there",
           "1, 2, 3, 4, 5,", "Repeat after me: red, green, blue, red, green, blue,",
           "import numpy as np\n", "The quick brown fox", "Q: What is 2 + 2?\nA:"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def bf16_llm():
    from deepinfer import LLM
    # The GGUF expanded to bf16: the stack's bf16 GEMVs against the per-op bf16 kernels.
    return LLM(model=None, dtype="bfloat16", quantization="bf16", kv_cache_memory="128MiB",
               seed=0, enable_prefix_caching=False)


def _generate(llm, prompts, stack_on: bool):
    inner = llm.engine.model.model
    stack = inner.decode_stack
    assert stack is not None, "the default bf16 model should get the decode stack"
    calls = _counting(stack)
    if not stack_on:
        inner.decode_stack = None
    try:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        inner.decode_stack = stack
    assert bool(calls) == stack_on
    return [(o.outputs[0].token_ids, [(lp.token_id, lp.logprob) for lp in o.outputs[0].logprobs])
            for o in outputs]


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_default_model_greedy_tokens_and_logprobs_equal(bf16_llm, batch, gemv_for_every_row):
    prompts = PROMPTS[:batch]
    assert _generate(bf16_llm, prompts, True) == _generate(bf16_llm, prompts, False)


@pytest.mark.slow
def test_default_model_ngram_verification_rows_equal(bf16_llm, gemv_for_every_row):
    from deepinfer import LLM
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}
    llm = LLM(model=None, dtype="bfloat16", quantization="bf16", kv_cache_memory="128MiB",
              seed=0, enable_prefix_caching=False, share_weights_with=bf16_llm,
              speculative_config=spec)
    prompts = PROMPTS[3:5]  # repetitive: the drafts are often accepted (5-row verifications)
    assert _generate(llm, prompts, True) == _generate(llm, prompts, False)


@pytest.mark.slow
def test_default_quantized_model_greedy_tokens_and_logprobs_equal():
    """The model as shipped (Q4_1 weights): the per-op path runs the C SiLU and rotary too (its
    MLPs and attentions hold only quantized weights), so both paths give the same bits."""
    from deepinfer import LLM
    llm = LLM(kv_cache_memory="128MiB", seed=0, enable_prefix_caching=False)
    assert _generate(llm, PROMPTS, True) == _generate(llm, PROMPTS, False)


def test_out_of_range_ids_positions_and_blocks_are_errors_not_wild_reads():
    shape = SHAPES[0]
    model = _fast_random_model(shape, seed=6)
    stack = model.model.decode_stack
    gen = torch.Generator().manual_seed(7)
    with torch.inference_mode():
        cache, meta, ids, positions = _decode_step(model, gen, 2)
        attn = PagedAttention(cache, meta, shape[1])
        before = cache.kv.clone()
        bad_block = meta.decode.block_ids.clone()
        bad_block[0] = cache.num_blocks
        for bad_ids, bad_pos, blocks in ((ids + model.config.vocab_size, positions, None),
                                         (ids, positions + 10_000, None),
                                         (ids, positions, bad_block)):
            if blocks is not None:
                meta.decode.block_ids = blocks
            with pytest.raises(IndexError):
                stack(bad_ids, bad_pos, attn)
        assert torch.equal(cache.kv, before)
