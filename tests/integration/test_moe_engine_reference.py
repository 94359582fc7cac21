"""Engine greedy decoding of tiny MoE checkpoints (Mixtral, Qwen3-MoE with sparse step,
DeepSeek-V3 with and without q_lora) vs transformers fp32: mixed batches, 500+ token prompts
under chunked prefill, prefix-cache hits and forced preemption. DeepSeek runs on the MLA latent
cache (absorbed decode, expanded prefill). Tokens must equal the reference up to the first
near-tie (as for the dense model), sampled-token log-probs within 2e-3, and the engine idle
with its invariants after every generate.
"""
from __future__ import annotations

import pytest
import torch

from deepinfer import SamplingParams
from tests.integration.engine_checks import generate_checked, token_prompts
from tests.integration.hf_reference import HFReference, assert_matches_reference
from tests.integration.moe_checkpoints import random_prompts, tiny_moe_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

KINDS = ["mixtral", "qwen3_moe_sparse_step", "deepseek_v3", "deepseek_v3_no_q_lora", "deepseek_v2"]
MAX_TOKENS = 12
BLOCK_SIZE = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
DISTINCT_LENGTHS = (3, 17, 60, 130, 520)
SHARED_PREFIX = 70


class TinyReference(HFReference):
    """HFReference over an in-memory transformers model (no GGUF, no tokenizer)."""

    def __init__(self, model) -> None:
        self.model = model
        self.tokenizer = None
        self._cache = {}


@pytest.fixture(scope="module")
def moe_setups(tmp_path_factory, default_model_source):
    """kind -> (reference, directory); each directory also holds the default model's tokenizer."""
    tokenizer = default_model_source.load_tokenizer()
    out = {}
    for i, kind in enumerate(KINDS):
        model = tiny_moe_model(kind, seed=20 + i)
        directory = tmp_path_factory.mktemp(f"engine_{kind}")
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        out[kind] = (TinyReference(model), str(directory))
    return out


def make_llm(directory: str, **kwargs):
    from deepinfer import LLM
    kwargs.setdefault("kv_cache_memory", "64MiB")
    return LLM(model=directory, dtype="float32", seed=0, block_size=BLOCK_SIZE, **kwargs)


def assert_outputs_match(reference, outputs, prompts, label: str) -> None:
    num_checked = 0
    for i, (out, prompt) in enumerate(zip(outputs, prompts)):
        assert list(out.prompt_token_ids) == list(prompt), f"{label}: output {i} is for another prompt"
        completion = out.outputs[0]
        assert len(completion.token_ids) == MAX_TOKENS and completion.finish_reason == "length"
        ref = reference.score(prompt, completion.token_ids)
        assert_matches_reference(ref, f"{label} prompt {i}")
        checked = ref.num_checked_tokens
        for step in range(checked):
            lp = completion.logprobs[step]
            want = ref.logprobs[step, lp.token_id].item()
            assert abs(lp.logprob - want) < 2e-3, f"{label} prompt {i} step {step}: {lp.logprob} vs {want}"
        num_checked += checked
    assert num_checked >= 0.75 * MAX_TOKENS * len(prompts), f"{label}: too many near-ties"


@pytest.mark.parametrize("kind", KINDS)
def test_moe_engine_matches_transformers(moe_setups, kind):
    reference, directory = moe_setups[kind]
    distinct = random_prompts(seed=5, lengths=DISTINCT_LENGTHS)

    llm = make_llm(directory, enable_prefix_caching=False)
    if kind.startswith("deepseek"):
        from deepinfer.runtime.latent_kv_cache import PagedLatentKVCache
        assert isinstance(llm.engine.cache, PagedLatentKVCache)
    assert_outputs_match(reference, generate_checked(llm, token_prompts(distinct), GREEDY), distinct, "batch")

    # A 32-token budget splits the 520-token prompt into 17 chunks mixed with decodes.
    chunked = make_llm(directory, enable_prefix_caching=False, max_num_batched_tokens=32)
    outputs = generate_checked(chunked, token_prompts(distinct), GREEDY)
    assert_outputs_match(reference, outputs, distinct, "chunked")
    assert chunked.engine.get_stats().num_steps >= 520 // 32

    # Prompts one token short of full blocks take 12 blocks to prefill and 17 once decoding:
    # 12 blocks admit them all, then their growth must preempt.
    growing = random_prompts(seed=8, lengths=(15, 31, 47, 63, 31))
    small = make_llm(directory, num_kv_blocks=12, enable_prefix_caching=True)
    outputs = generate_checked(small, token_prompts(growing), GREEDY)
    assert small.engine.get_stats().num_preemptions > 0, "the tiny KV cache never preempted"
    assert_outputs_match(reference, outputs, growing, "preempted")


@pytest.mark.parametrize("kind", ["mixtral", "deepseek_v3"])
def test_moe_prefix_cache_hits_match_transformers(moe_setups, kind):
    reference, directory = moe_setups[kind]
    prefix = random_prompts(seed=6, lengths=(SHARED_PREFIX,))[0]
    shared = [prefix + tail for tail in random_prompts(seed=7, lengths=(5, 20, 41))]
    llm = make_llm(directory, enable_prefix_caching=True)
    first = generate_checked(llm, token_prompts(shared[:1]), GREEDY)
    assert_outputs_match(reference, first, shared[:1], "prefix cold")
    second = generate_checked(llm, token_prompts(shared), GREEDY)
    assert_outputs_match(reference, second, shared, "prefix warm")
    for out in second:
        assert out.num_cached_tokens >= (SHARED_PREFIX // BLOCK_SIZE) * BLOCK_SIZE
    assert list(second[0].outputs[0].token_ids) == list(first[0].outputs[0].token_ids)


def test_mla_cache_spec_and_bytes(moe_setups):
    """Per token the MLA cache holds (kv_lora_rank + qk_rope_head_dim) x layers values."""
    from deepinfer.runtime.kv_cache_spec import allocate_kv_cache, kv_bytes_per_token, kv_cache_spec_for
    from deepinfer.runtime.latent_kv_cache import MLAKVCacheSpec
    from deepinfer.runtime.model_source import resolve_model

    config = resolve_model(moe_setups["deepseek_v3"][1]).config
    spec = kv_cache_spec_for(config, 16, torch.bfloat16)
    assert isinstance(spec, MLAKVCacheSpec)
    per_token = (32 + 8) * 3 * 2  # (kv_lora_rank + rope) x layers x bf16
    assert kv_bytes_per_token(spec) == per_token == config.kv_bytes_per_token(2)
    assert spec.bytes_per_block == 16 * per_token
    assert spec.num_blocks_for(10 * spec.bytes_per_block + 5) == 10
    cache = allocate_kv_cache(spec, 4, torch.device("cpu"))
    assert cache.kv.shape == (3, 4, 16, 40) and cache.kv.dtype == torch.bfloat16
    assert cache.kv.numel() * 2 == 4 * spec.bytes_per_block
    data = torch.randn(3, 2, 16, 40)
    cache.write_blocks([3, 1], data)
    assert torch.equal(cache.read_blocks([1, 3]), data.flip(1).to(torch.bfloat16))
    # The MHA spec of the same width would need per-head K and V: far more bytes.
    mixtral = resolve_model(moe_setups["mixtral"][1]).config
    assert kv_bytes_per_token(kv_cache_spec_for(mixtral, 16, torch.bfloat16)) == 2 * 3 * 2 * 16 * 2


def test_compute_aware_chunks_on_deepseek_match_transformers(moe_setups, tmp_path):
    """Variable chunk sizes from the compute-aware policy (a synthetic MoE-aware profile whose
    budget fits a few dozen prompt tokens per step) give the reference tokens."""
    import json

    from deepinfer.core.cost_model import CostModel
    from deepinfer.core.model_shape import ModelShape
    from deepinfer.runtime.model_source import resolve_model

    reference, directory = moe_setups["deepseek_v3"]
    shape = ModelShape.from_model_config(resolve_model(directory).config, 4)
    assert shape.num_experts == 8 and shape.expert_bytes > 0
    coefficients = {"linear_flops": 1e-3 / (2 * shape.active_params),
                    "attention_flops": 2e-3 / (shape.attention_flops_per_pair * 400),
                    "bytes_moved": 1e-3 / shape.weight_bytes, "step": 2e-3}
    profile = tmp_path / "moe_profile.json"
    profile.write_text(json.dumps(CostModel(shape, coefficients).to_dict()))
    prompts = random_prompts(seed=9, lengths=(4, 90, 300))
    llm = make_llm(directory, enable_prefix_caching=False, scheduler="compute-aware",
                   cost_profile=str(profile), step_time_budget_ms=60.0)
    outputs = generate_checked(llm, token_prompts(prompts), GREEDY)
    assert_outputs_match(reference, outputs, prompts, "compute-aware")
    assert llm.engine.get_stats().num_steps > MAX_TOKENS + 5  # the prompts really were chunked


def test_bf16_engine_with_packed_untied_head_runs_moe(moe_setups):
    """bf16 on CPU packs linear layers (the untied LM head included) for oneDNN; logits still
    come out, and decisive first tokens equal the fp32 reference."""
    reference, directory = moe_setups["mixtral"]
    prompts = random_prompts(seed=10, lengths=(6, 50))
    from deepinfer import LLM
    llm = LLM(model=directory, dtype="bfloat16", seed=0, kv_cache_memory="64MiB")
    outputs = generate_checked(llm, token_prompts(prompts), SamplingParams(temperature=0.0, max_tokens=4,
                                                                          ignore_eos=True))
    for prompt, out in zip(prompts, outputs):
        ref = reference.score(prompt, out.outputs[0].token_ids)
        if ref.top2_gaps[0] > 0.5:
            assert out.outputs[0].token_ids[0] == ref.greedy_token_ids[0]


@pytest.mark.timeout(300)
def test_profile_cli_on_tiny_deepseek(tmp_path, default_model_source):
    """`deepinfer profile` runs on an MoE + MLA model and writes an MoE-aware shape."""
    import json
    import subprocess
    import sys

    directory = tmp_path / "dsv3"
    tiny_moe_model("deepseek_v3", seed=3, max_position_embeddings=4096).save_pretrained(directory)
    default_model_source.load_tokenizer().save_pretrained(directory)
    out = tmp_path / "profile.json"
    code = "import sys; from deepinfer.cli.main import main; sys.exit(main())"
    proc = subprocess.run([sys.executable, "-c", code, "profile", "--model", str(directory),
                           "--grid", "quick", "--repeats", "1", "--threads", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr
    assert "held-out abs error" in proc.stdout
    data = json.loads(out.read_text())
    shape = data["model_shape"]
    assert shape["num_experts"] == 8 and shape["num_experts_per_tok"] == 2
    assert shape["kv_bytes_per_token"] == 3 * (32 + 8) * 2  # bf16 latent entry x layers
    assert data["holdout_median_abs_pct_error"] >= 0
