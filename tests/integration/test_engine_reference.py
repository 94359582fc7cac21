"""Engine greedy decoding vs Hugging Face transformers fp32 on the default model.

Every configuration — plain batch, prefix-cache hits, chunked prefill, preemption — must equal
the reference token for token, up to the first step whose reference top-2 logit gap < 1e-3.
After every `generate` the scheduler invariants hold and no KV block is left referenced.
"""
from __future__ import annotations

import json

import pytest

from deepinfer import SamplingParams
from tests.integration.engine_checks import generate_checked, token_prompts
from tests.integration.hf_reference import assert_matches_reference
from tests.integration.prompt_corpus import (SHARED_PREFIX_LENGTH, distinct_prompts,
                                             shared_prefix_prompts)

# One real-model check against transformers runs in `make test` (the mixed-length batch); the
# rest of the module is in the slow tier (`make test-slow`, run by CI).
pytestmark = [pytest.mark.timeout(300)]

MAX_TOKENS = 24
BLOCK_SIZE = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def distinct(hf_reference):
    """Eight prompts of 3..400 tokens with no shared prefix."""
    return distinct_prompts(hf_reference.encode)


@pytest.fixture(scope="module")
def shared(hf_reference):
    """Four prompts sharing their first SHARED_PREFIX_LENGTH tokens."""
    return shared_prefix_prompts(hf_reference.encode)


def assert_outputs_match(hf_reference, outputs, prompts, label: str) -> None:
    num_checked = 0
    for i, (out, prompt) in enumerate(zip(outputs, prompts)):
        assert list(out.prompt_token_ids) == list(prompt), f"{label}: output {i} is for another prompt"
        assert out.finished
        assert len(out.outputs) == 1
        completion = out.outputs[0]
        assert len(completion.token_ids) == MAX_TOKENS, f"{label}: prompt {i} length"
        assert completion.finish_reason == "length"
        ref = hf_reference.score(prompt, completion.token_ids)
        assert_matches_reference(ref, f"{label} prompt {i}")
        num_checked += ref.num_checked_tokens
    # Guard against a vacuous comparison: most steps must be decisive in the reference.
    assert num_checked >= 0.75 * MAX_TOKENS * len(prompts), f"{label}: too many near-ties"


def test_greedy_batch_of_mixed_lengths_matches_hf(make_engine_llm, hf_reference, distinct):
    llm = make_engine_llm(enable_prefix_caching=False)
    outputs = generate_checked(llm, token_prompts(distinct), GREEDY)
    assert_outputs_match(hf_reference, outputs, distinct, "batch")
    assert all(out.num_cached_tokens == 0 for out in outputs)


@pytest.mark.slow
def test_prefix_cache_hits_match_hf(make_engine_llm, hf_reference, shared):
    llm = make_engine_llm(enable_prefix_caching=True)
    first = generate_checked(llm, token_prompts(shared[:1]), GREEDY)
    assert_outputs_match(hf_reference, first, shared[:1], "prefix cold")

    # Second pass: prompt 0 is fully cached, the others hit the shared prefix's full blocks.
    second = generate_checked(llm, token_prompts(shared), GREEDY)
    assert_outputs_match(hf_reference, second, shared, "prefix warm")
    shared_full_blocks = (SHARED_PREFIX_LENGTH // BLOCK_SIZE) * BLOCK_SIZE
    for i, out in enumerate(second):
        assert out.num_cached_tokens >= shared_full_blocks, (
            f"prompt {i}: {out.num_cached_tokens} cached tokens, expected >= {shared_full_blocks}")
        assert out.num_cached_tokens < len(shared[i])  # the last prompt token is recomputed
    assert list(second[0].outputs[0].token_ids) == list(first[0].outputs[0].token_ids)
    stats = llm.engine.get_stats()
    assert stats.prefix_cache_hits > 0 and stats.prefix_cache_queries >= stats.prefix_cache_hits

    # Third pass, same batch again: everything hits, still the reference tokens.
    third = generate_checked(llm, token_prompts(shared), GREEDY)
    assert_outputs_match(hf_reference, third, shared, "prefix hot")


@pytest.mark.slow
def test_chunked_prefill_matches_hf(make_engine_llm, hf_reference, distinct):
    # A 32-token budget forces every prompt above 32 tokens (up to 400) into many chunks,
    # mixed with other requests' decode tokens in the same steps.
    llm = make_engine_llm(enable_prefix_caching=False, max_num_batched_tokens=32)
    outputs = generate_checked(llm, token_prompts(distinct), GREEDY)
    assert_outputs_match(hf_reference, outputs, distinct, "chunked")
    # The 400-token prompt alone needs 13 prefill steps before its 23 decode steps.
    assert llm.engine.get_stats().num_steps >= -(-max(map(len, distinct)) // 32) + MAX_TOKENS - 1


@pytest.mark.slow
def test_compute_aware_chunks_match_hf(engine_base_llm, make_engine_llm, hf_reference, distinct,
                                       tmp_path):
    """Variable, block-aligned chunk sizes from the compute-aware policy (a synthetic cost
    profile whose budget fits a few dozen prompt tokens per step) give the same tokens."""
    from deepinfer.core.cost_model import CostModel
    from deepinfer.core.model_shape import ModelShape
    shape = ModelShape.from_model_config(engine_base_llm.engine.model_config, 4)
    # ~1 ms per prompt token of linear work, attention growing with context, 2 ms per step.
    per_token_s = 1e-3
    coefficients = {"linear_flops": per_token_s / (2 * shape.active_params),
                    "attention_flops": 2e-3 / (shape.attention_flops_per_pair * 400),
                    "step": 2e-3}
    profile = tmp_path / "synthetic_profile.json"
    profile.write_text(json.dumps(CostModel(shape, coefficients).to_dict()))
    llm = make_engine_llm(enable_prefix_caching=False, scheduler="compute-aware",
                          cost_profile=str(profile), step_time_budget_ms=60.0)
    outputs = generate_checked(llm, token_prompts(distinct), GREEDY)
    assert_outputs_match(hf_reference, outputs, distinct, "compute-aware chunks")
    # Without chunking the batch would take exactly MAX_TOKENS steps.
    assert llm.engine.get_stats().num_steps > MAX_TOKENS + 5


@pytest.mark.slow
@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_preemption_matches_hf(make_engine_llm, hf_reference, distinct, enable_prefix_caching):
    prompts = distinct[:6]  # 3..150 tokens
    # The largest request needs ceil((150 + 24) / 16) = 11 blocks; all six together need 33.
    # 14 blocks admit several prompts whose growth during decode must then preempt others.
    llm = make_engine_llm(num_kv_blocks=14, enable_prefix_caching=enable_prefix_caching)
    outputs = generate_checked(llm, token_prompts(prompts), GREEDY)
    assert llm.engine.get_stats().num_preemptions > 0, "the tiny KV cache never preempted"
    assert_outputs_match(hf_reference, outputs, prompts, "preempted")


@pytest.mark.slow
def test_repeated_prompt_reports_cached_tokens(engine_base_llm, hf_reference):
    text = ("A binary search tree keeps its keys in sorted order, so an in-order walk visits "
            "them from the smallest to the largest. Explain why a balanced tree matters for "
            "lookups, and what happens when keys arrive already sorted.")
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    first = generate_checked(engine_base_llm, [text], params)[0]
    second = generate_checked(engine_base_llm, [text], params)[0]
    prompt_len = len(first.prompt_token_ids)
    assert prompt_len > 2 * BLOCK_SIZE
    assert second.num_cached_tokens > 0
    assert second.num_cached_tokens >= ((prompt_len - 1) // BLOCK_SIZE) * BLOCK_SIZE
    assert list(second.prompt_token_ids) == list(first.prompt_token_ids)
    assert list(second.outputs[0].token_ids) == list(first.outputs[0].token_ids)
    assert second.outputs[0].text == first.outputs[0].text
    ref = hf_reference.score(first.prompt_token_ids, first.outputs[0].token_ids)
    assert_matches_reference(ref, "repeated prompt")


@pytest.mark.slow
def test_string_and_token_prompts_mixed_keep_order(engine_base_llm, hf_reference, distinct):
    text = "The capital of France is"
    mixed = [text, {"prompt_token_ids": distinct[2]}, text + " not",
             {"prompt_token_ids": distinct[0]}]
    outputs = generate_checked(engine_base_llm, mixed, GREEDY)
    # String prompts are tokenized as transformers does by default (vLLM behaviour).
    assert list(outputs[0].prompt_token_ids) == list(hf_reference.tokenizer(text).input_ids)
    assert list(outputs[2].prompt_token_ids) == list(
        hf_reference.tokenizer(text + " not").input_ids)
    assert_outputs_match(hf_reference, outputs, [o.prompt_token_ids for o in outputs], "mixed")
    ids = [o.request_id for o in outputs]
    assert len(set(ids)) == len(ids), "request ids must be unique"
