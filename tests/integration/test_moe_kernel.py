"""The MoE experts decode kernel (runtime/cpu_moe_kernel.py) against the torch path: bf16 and
quantized experts within the rounding bound of moe_kernel_check (bf16 almost always bit for
bit, quantized always: both run the same quantized rows), batches past one 8-row tile with
skewed routing, inputs it must refuse, and tiny Qwen3-MoE / DeepSeek-V3 / FP8 Qwen3-MoE checkpoints
whose bf16 decode runs on it: greedy tokens equal the torch path's and, wherever the
reference's top-2 gap is not a bf16-sized near-tie, transformers' fp32 reference's."""
from __future__ import annotations

import pytest
import torch

from deepinfer.moe.layer import MoEExperts
from deepinfer.quant.fused_quantized import QuantizedMoEExperts
from deepinfer.runtime import cpu_moe_kernel
from deepinfer.runtime.cpu_kernel_build import kernels_enabled
from deepinfer.runtime.cpu_quant_linear import load_quant_linear
from deepinfer.runtime.moe_kernel_check import (random_quantized_experts, random_routing,
                                                rounding_bound)

pytestmark = pytest.mark.timeout(600)
BF16_GAP = 0.5  # reference top-2 gaps below this may flip in bf16 (as the other bf16 tests)
WIDE_TOKENS = (9, 16, 33, 64)  # decode batches past one 8-row tile (with the kernel's bound)


@pytest.fixture(scope="module")
def kernel():
    if not kernels_enabled():
        pytest.skip("DEEPINFER_CPU_KERNELS=0")
    loaded = cpu_moe_kernel.load_moe_kernel()
    assert loaded is not None, "the MoE kernel did not build or failed its self-test here"
    assert loaded.takes_bf16 and loaded.takes_quantized
    return loaded


def _random_experts(num_experts, hidden, inter, gen) -> MoEExperts:
    experts = MoEExperts(num_experts, hidden, inter, torch.bfloat16).to("cpu")
    experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=gen) / hidden ** 0.5)
    experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=gen) / inter ** 0.5)
    return experts


def _assert_close(got, want, bound, case):
    err = (got.double() - want.double()).abs()
    assert (err <= bound).all(), f"{case}: max error {err.max().item():.3g}"
    # The same roundings of the same sums: a value differs only where a float32 dot summed in
    # another order rounds to another bf16 value, which is rare.
    assert (got == want).float().mean().item() >= 0.95, case


@pytest.mark.parametrize("num_experts,hidden,inter,k", [(64, 256, 96, 8), (10, 77, 45, 3),
                                                          (4, 24, 8, 4)])
@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_kernel_matches_torch_path(kernel, num_experts, hidden, inter, k, threads):
    gen = torch.Generator().manual_seed(num_experts + threads)
    experts = _random_experts(num_experts, hidden, inter, gen)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for num_tokens in (*range(1, 9), *WIDE_TOKENS, kernel.max_tokens):
            x = torch.randn(num_tokens, hidden, generator=gen).bfloat16()
            weights, ids = random_routing(num_tokens, num_experts, k, gen)
            got = kernel.bf16(x, weights, ids, experts.gate_up_proj, experts.down_proj)
            want = experts.torch_forward(x, weights, ids)
            bound = rounding_bound(x, weights, ids, experts.gate_up_proj.float(),
                                   experts.down_proj.float())
            _assert_close(got, want, bound, f"T={num_tokens}")
    finally:
        torch.set_num_threads(old)


def skewed_routing(kind: str, num_tokens: int, num_experts: int, k: int, gen: torch.Generator):
    """(weights [T, k] f32, ids [T, k]) with distinct experts per token: "one_expert" puts
    every token on expert 3 (plus random others), "every_expert" cycles through all experts."""
    weights, ids = random_routing(num_tokens, num_experts, k, gen)
    if kind == "one_expert":
        for row in ids:
            hot = (row == 3).nonzero()
            row[hot[0, 0] if len(hot) else 0] = row[0]
            row[0] = 3
    elif kind == "every_expert":
        first = torch.arange(num_tokens) * k
        ids = (first[:, None] + torch.arange(k)) % num_experts
    return weights, ids


@pytest.mark.parametrize("k", [1, 2, 8])
@pytest.mark.parametrize("routing", ["one_expert", "every_expert"])
def test_bf16_kernel_takes_wide_batches_with_skewed_routing(kernel, k, routing):
    """Decode batches past one tile, an expert with every token (its rows split over both
    threads by cost) or every expert busy: the torch path's values, the same on 1 and 2
    threads."""
    gen = torch.Generator().manual_seed(20 + k)
    experts = _random_experts(12, 256, 136, gen)
    old = torch.get_num_threads()
    try:
        for num_tokens in (*WIDE_TOKENS, kernel.max_tokens):
            x = torch.randn(num_tokens, 256, generator=gen).bfloat16()
            weights, ids = skewed_routing(routing, num_tokens, 12, k, gen)
            outs = []
            for threads in (1, 2):
                torch.set_num_threads(threads)
                outs.append(kernel.bf16(x, weights, ids, experts.gate_up_proj, experts.down_proj))
            assert torch.equal(outs[0], outs[1]), f"T={num_tokens}: thread count changed bits"
            want = experts.torch_forward(x, weights, ids)
            bound = rounding_bound(x, weights, ids, experts.gate_up_proj.float(),
                                   experts.down_proj.float())
            _assert_close(outs[0], want, bound, f"{routing} k={k} T={num_tokens}")
    finally:
        torch.set_num_threads(old)


def test_bf16_kernel_sums_shared_experts_in_one_order(kernel):
    """Every token on the same experts (each expert's GEMV runs all 8 rows), weights of mixed
    sign and scale: the same result with 1 and 2 threads, and the torch path's."""
    gen = torch.Generator().manual_seed(3)
    experts = _random_experts(8, 128, 64, gen)
    x = torch.randn(8, 128, generator=gen).bfloat16()
    ids = torch.tensor([[5, 1, 7]] * 8)
    weights = torch.randn(8, 3, generator=gen) * 3
    outs = []
    old = torch.get_num_threads()
    for threads in (1, 2):
        torch.set_num_threads(threads)
        outs.append(kernel.bf16(x, weights, ids, experts.gate_up_proj, experts.down_proj))
    torch.set_num_threads(old)
    assert torch.equal(outs[0], outs[1])
    want = experts.torch_forward(x, weights, ids)
    _assert_close(outs[0], want, rounding_bound(x, weights, ids, experts.gate_up_proj.float(),
                                                experts.down_proj.float()), "shared experts")


def test_forward_uses_kernel_for_decode_and_torch_path_beyond(kernel, monkeypatch):
    gen = torch.Generator().manual_seed(4)
    experts = _random_experts(8, 64, 32, gen)
    experts.kernel = kernel
    calls = []
    real = kernel.bf16
    monkeypatch.setattr(kernel, "bf16", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for num_tokens in (1, 40, kernel.max_tokens, kernel.max_tokens + 1, 300):
        x = torch.randn(num_tokens, 64, generator=gen).bfloat16()
        weights, ids = random_routing(num_tokens, 8, 2, gen)
        got = experts(x, weights, ids)
        want = experts.torch_forward(x, weights, ids)
        _assert_close(got, want, rounding_bound(x, weights, ids, experts.gate_up_proj.float(),
                                                experts.down_proj.float()), f"T={num_tokens}")
    assert calls == [1, 40, kernel.max_tokens]


def test_kernel_refuses_what_it_does_not_take(kernel):
    gen = torch.Generator().manual_seed(5)
    experts = _random_experts(6, 32, 16, gen)
    weights, ids = random_routing(2, 6, 2, gen)
    x = torch.randn(2, 32, generator=gen).bfloat16()
    gu, down = experts.gate_up_proj, experts.down_proj
    assert kernel.bf16(x.float(), weights, ids, gu, down) is None  # float32 activations
    assert kernel.bf16(torch.randn(32, 4).bfloat16().T[:2], weights, ids, gu, down) is None
    assert kernel.bf16(x, weights, ids, gu.float(), down.float()) is None
    assert kernel.bf16(x[:, :31], weights, ids, gu, down) is None  # hidden mismatch
    assert kernel.bf16(x, weights[:, :1], ids, gu, down) is None  # weights / ids shapes differ
    big = torch.randn(kernel.max_tokens + 1, 32).bfloat16()
    assert kernel.bf16(big, *random_routing(len(big), 6, 2, gen), gu, down) is None
    for bad in (6, -1):  # an expert id out of range is an error, never a stray read
        with pytest.raises(RuntimeError):
            kernel.bf16(x, weights, torch.tensor([[0, bad], [1, 2]]), gu, down)


@pytest.mark.parametrize("fmt,hidden,inter", [("fp8_block", 256, 128), ("fp8_block", 136, 40),
                                              ("q4_k", 256, 256), ("q6_k", 256, 256),
                                              ("q4_0", 64, 96), ("int8", 48, 20)])
def test_quantized_kernel_matches_torch_path(kernel, fmt, hidden, inter):
    quant = load_quant_linear()
    gen = torch.Generator().manual_seed(hidden + inter)
    experts = random_quantized_experts(fmt, 12, hidden, inter, gen, quant)
    assert cpu_moe_kernel.attach_quantized(experts, kernel) == 1
    gate_up = torch.stack([torch.cat([p.dequantize() for p in m.parts]) for m in experts.gate_up])
    down = torch.stack([m.qweight.dequantize() for m in experts.down])
    old = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for num_tokens in (1, 2, 5, 8):
                x = torch.randn(num_tokens, hidden, generator=gen).bfloat16()
                weights, ids = random_routing(num_tokens, 12, 4, gen)
                got = experts(x, weights, ids)  # forward: the kernel
                want = experts.torch_forward(x, weights, ids)
                bound = rounding_bound(x, weights, ids, gate_up, down, int8_acts=fmt != "fp8_block")
                _assert_close(got, want, bound, f"{fmt} T={num_tokens} threads={threads}")
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("fmt,hidden,inter", [("fp8_block", 256, 128), ("fp8_block", 136, 40),
                                              ("q4_k", 256, 256), ("q6_k", 256, 256),
                                              ("q4_0", 64, 96), ("int8", 48, 20)])
def test_quantized_kernel_takes_wide_batches_bit_for_bit(kernel, fmt, hidden, inter):
    """Past one tile the experts' GEMVs run the quantized-linear kernel's rows for every M,
    as the torch path's projections do: the same bits, skewed routing included."""
    quant = load_quant_linear()
    gen = torch.Generator().manual_seed(hidden + inter + 1)
    experts = random_quantized_experts(fmt, 12, hidden, inter, gen, quant)
    assert cpu_moe_kernel.attach_quantized(experts, kernel) == 1
    old = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for num_tokens in (*WIDE_TOKENS, kernel.max_tokens):
                for k, routing in ((1, "one_expert"), (2, "every_expert"), (8, "one_expert")):
                    x = torch.randn(num_tokens, hidden, generator=gen).bfloat16()
                    weights, ids = skewed_routing(routing, num_tokens, 12, k, gen)
                    got = experts(x, weights, ids)  # forward: the kernel
                    want = experts.torch_forward(x, weights, ids)
                    assert torch.equal(got, want), f"{fmt} {routing} k={k} T={num_tokens} threads={threads}"
    finally:
        torch.set_num_threads(old)


def test_quantized_experts_with_a_bias_keep_the_torch_path(kernel):
    from deepinfer.quant.quantized_linear import QuantizedLinear

    gen = torch.Generator().manual_seed(6)
    experts = random_quantized_experts("q8_0", 3, 64, 32, gen, load_quant_linear())
    first = experts.down[0]
    experts.down[0] = QuantizedLinear(first.qweight, torch.zeros(64, dtype=torch.bfloat16))
    assert cpu_moe_kernel.attach_quantized(experts, kernel) == 0 and experts.kernel is None


# ---- whole models ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, default_model_source):
    """kind -> (transformers fp32 model, checkpoint dir): bf16-loadable tiny MoE models."""
    from transformers import AutoModelForCausalLM

    from tests.integration.fp8_checkpoints import fp8_hf_model, write_fp8_pair
    from tests.integration.moe_checkpoints import tiny_moe_model

    tokenizer = default_model_source.load_tokenizer()
    out = {}
    for i, kind in enumerate(("qwen3_moe", "deepseek_v3")):
        model = tiny_moe_model(kind, seed=60 + i, num_experts_per_tok=4 if kind == "qwen3_moe" else 2)
        directory = tmp_path_factory.mktemp(f"kernel_{kind}")
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        out[kind] = (model.eval(), str(directory))
    root = tmp_path_factory.mktemp("kernel_fp8")
    write_fp8_pair(fp8_hf_model("qwen3_moe", seed=62), str(root / "fp8"), str(root / "ref"), tokenizer)
    ref = AutoModelForCausalLM.from_pretrained(str(root / "ref"), dtype=torch.float32).eval()
    out["fp8_qwen3_moe"] = (ref, str(root / "fp8"))
    return out


def _routed_experts(model) -> list:
    return [m for m in model.modules() if isinstance(m, (MoEExperts, QuantizedMoEExperts))]


def _generate(llm, prompts, max_tokens):
    from deepinfer import SamplingParams
    from tests.integration.engine_checks import generate_checked, token_prompts

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in generate_checked(llm, token_prompts(prompts), params)]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3", "fp8_qwen3_moe"])
def test_bf16_decode_on_kernel_equals_torch_path_and_reference(kernel, checkpoints, kind, monkeypatch):
    from deepinfer import LLM
    from tests.integration.moe_checkpoints import random_prompts
    from tests.integration.test_moe_engine_reference import TinyReference

    reference, directory = checkpoints[kind]
    llm = LLM(model=directory, dtype="bfloat16", seed=0, kv_cache_memory="32MiB")
    layers = _routed_experts(llm.engine.model)
    installed = layers[0].kernel
    assert isinstance(installed, cpu_moe_kernel.MoEExpertsKernel)
    assert all(m.kernel is installed for m in layers), "every routed layer runs the kernel"
    calls = []
    real = installed.quantized if kind.startswith("fp8") else installed.bf16
    monkeypatch.setattr(installed, real.__name__, lambda *a: calls.append(1) or real(*a))
    prompts = random_prompts(seed=13, lengths=(2, 9, 33, 5, 17, 3))
    with_kernel = _generate(llm, prompts, 10)  # 6 concurrent decodes: 6-token steps
    assert len(calls) >= 9 * len(layers), "decode steps ran on the kernel"
    for layer in layers:
        layer.kernel = None
    assert _generate(llm, prompts, 10) == with_kernel  # the torch path decodes the same tokens
    ref = TinyReference(reference)
    num_checked = 0
    for prompt, tokens in zip(prompts, with_kernel):
        # The reference is fed the engine's own tokens, so every position is comparable; only
        # those with a bf16-sized top-2 gap may flip.
        trace = ref.score(prompt, tokens)
        for step, (got, want) in enumerate(zip(tokens, trace.greedy_token_ids)):
            if trace.top2_gaps[step] >= BF16_GAP:
                assert got == want, f"{kind}: step {step} of a {len(prompt)}-token prompt"
                num_checked += 1
    assert num_checked >= 25, "too few decisive tokens to compare with the reference"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3"])
def test_sixteen_way_decode_on_kernel_equals_torch_path(kernel, checkpoints, kind, monkeypatch):
    """16 concurrent decodes: steps of 9..16 tokens run on the kernel (past one tile) and
    decode the torch path's greedy tokens."""
    from deepinfer import LLM
    from tests.integration.moe_checkpoints import random_prompts

    llm = LLM(model=checkpoints[kind][1], dtype="bfloat16", seed=0, kv_cache_memory="32MiB",
              enable_prefix_caching=False)  # the torch run recomputes every prompt
    layers = _routed_experts(llm.engine.model)
    installed = layers[0].kernel
    assert isinstance(installed, cpu_moe_kernel.MoEExpertsKernel)
    rows = []
    real = installed.bf16
    monkeypatch.setattr(installed, "bf16", lambda x, *a: rows.append(x.shape[0]) or real(x, *a))
    prompts = random_prompts(seed=17, lengths=tuple(2 + (5 * i) % 23 for i in range(16)))
    with_kernel = _generate(llm, prompts, 8)
    assert rows.count(16) >= 6 * len(layers), "16-token decode steps ran on the kernel"
    for layer in layers:
        layer.kernel = None
    assert _generate(llm, prompts, 8) == with_kernel


def test_self_test_catches_a_wrong_kernel(kernel, monkeypatch):
    """A kernel that computes the wrong experts fails the load-time check (bf16 and quantized)."""
    from deepinfer.runtime import moe_kernel_check as check
    from deepinfer.runtime.cpu_moe_kernel import attach_quantized

    bf16, quantized = kernel.bf16, kernel.quantized
    monkeypatch.setattr(kernel, "bf16", lambda x, w, ids, gu, dn: bf16(x, w, (ids + 1) % gu.shape[0], gu, dn))
    monkeypatch.setattr(kernel, "quantized", lambda x, w, ids, descs, inter: quantized(
        x, w, (ids + 1) % descs.shape[0], descs, inter))
    assert check.bf16_mismatch(kernel) is not None
    assert check.quant_mismatch(kernel, load_quant_linear(), attach_quantized) is not None


def test_disagreeing_kernel_leaves_the_torch_path_with_a_warning(kernel, monkeypatch, caplog):
    from deepinfer.runtime import cpu_kernel_build, moe_kernel_check

    gen = torch.Generator().manual_seed(7)
    model = torch.nn.ModuleList([_random_experts(4, 32, 16, gen) for _ in range(2)])
    monkeypatch.setattr(cpu_kernel_build, "_VERDICTS", {})  # run the self-test afresh
    monkeypatch.setattr(moe_kernel_check, "bf16_mismatch", lambda k: "forced disagreement")
    cpu_moe_kernel._load.cache_clear()
    try:
        with caplog.at_level("WARNING"):
            assert cpu_moe_kernel.install_moe_kernels(model) == 0
        assert all(m.kernel is None for m in model)
        assert "forced disagreement" in caplog.text and "torch path" in caplog.text
    finally:
        cpu_moe_kernel._load.cache_clear()  # later loads verify the real kernel again
