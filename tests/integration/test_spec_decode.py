"""Speculative decoding on the default model (fp32): every method, k = 1..6, gives exactly the
tokens of the same engine without speculation (greedy, and seeded sampling for drafters with
one-hot q), in a batch, under preemption, on prefix-cache hits, with stop strings and
log-probs, and its counters add up. Draft models: a tiny random one with SmolLM2's vocabulary
(drafts mostly rejected) and the default model drafting for itself (mostly accepted).
"""
from __future__ import annotations

import pytest

from deepinfer import SamplingParams
from tests.integration.engine_checks import generate_checked, run_handoff

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CODE = ("def mean(values):\n    total = 0\n    for value in values:\n        total += value\n"
        "    return total / len(values)\n\n")
PROMPTS = [
    CODE + "# The same function with `values` renamed to `xs`:\ndef mean(xs):\n",
    "Repeat after me: red, green, blue, red, green, blue, red, green,",
    CODE + "# Add type hints:\n",
    "The capital of France is",
]
MAX_TOKENS = 20
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)


def ngram(k: int) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def baseline(engine_base_llm):
    return generate_checked(engine_base_llm, PROMPTS, GREEDY)


@pytest.fixture(scope="module")
def tiny_drafter(tmp_path_factory, default_model_source):
    """A random 1-layer Llama with SmolLM2's vocabulary: a drafter that is mostly wrong."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = default_model_source.config.vocab_size
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=8192, tie_word_embeddings=True)
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("tiny_drafter")
    LlamaForCausalLM(config).save_pretrained(directory)
    return str(directory)


def assert_same(outputs, reference, label: str, logprob_tol: float = 1e-4) -> None:
    for i, (out, ref) in enumerate(zip(outputs, reference)):
        got, want = out.outputs[0], ref.outputs[0]
        assert got.token_ids == want.token_ids, f"{label}: prompt {i} differs"
        assert got.text == want.text and got.finish_reason == want.finish_reason
        if want.logprobs is not None:
            assert len(got.logprobs) == len(want.logprobs)
            for a, b in zip(got.logprobs, want.logprobs):
                assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < logprob_tol


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6])
def test_ngram_greedy_equals_no_speculation(make_engine_llm, baseline, k):
    llm = make_engine_llm(speculative_config=ngram(k))
    outputs = generate_checked(llm, PROMPTS, GREEDY)
    assert_same(outputs, baseline, f"ngram k={k}")
    stats = llm.engine.get_stats()
    assert stats.spec_decode_num_drafts > 0 and stats.spec_decode_num_accepted_tokens > 0
    assert stats.spec_decode_num_draft_tokens <= k * stats.spec_decode_num_drafts
    assert sum(stats.spec_decode_num_accepted_tokens_per_pos) == \
        stats.spec_decode_num_accepted_tokens
    # Fewer target steps than tokens: several tokens were emitted per verification.
    assert stats.num_steps < MAX_TOKENS + 1


@pytest.mark.parametrize("k, drafter", [(2, "tiny"), (6, "tiny"), (3, "self")])
def test_draft_model_greedy_equals_no_speculation(make_engine_llm, baseline, tiny_drafter,
                                                  k, drafter):
    model = tiny_drafter if drafter == "tiny" else None
    llm = make_engine_llm(speculative_config={"method": "draft_model",
                                              "num_speculative_tokens": k, "model": model})
    outputs = generate_checked(llm, PROMPTS, GREEDY)
    assert_same(outputs, baseline, f"draft_model {drafter} k={k}")
    stats = llm.engine.get_stats()
    assert stats.spec_decode_num_drafts > 0
    if drafter == "self":  # its own model in fp32 agrees with itself almost always
        assert stats.spec_decode_mean_acceptance_length > 2.5


@pytest.mark.parametrize("config", [ngram(4), {"method": "draft_model",
                                               "num_speculative_tokens": 3}])
def test_preemption_and_prefix_hits_keep_outputs_equal(make_engine_llm, baseline, config):
    # 9 blocks of 16 tokens cannot hold the batch (14): requests are preempted and recomputed.
    llm = make_engine_llm(num_kv_blocks=9, speculative_config=config)
    first = generate_checked(llm, PROMPTS, GREEDY)
    assert_same(first, baseline, f"{config['method']} preempted")
    assert llm.engine.get_stats().num_preemptions > 0
    llm = make_engine_llm(speculative_config=config)
    generate_checked(llm, PROMPTS[:2], GREEDY)
    again = generate_checked(llm, PROMPTS[:3], GREEDY)  # hits the prefix cache (all three)
    assert all(o.num_cached_tokens > 0 for o in again)
    assert_same(again, baseline[:3], f"{config['method']} prefix hit")


def test_stop_strings_max_tokens_and_logprobs_are_exact(engine_base_llm, make_engine_llm,
                                                        baseline):
    text = baseline[1].outputs[0].text  # "... blue, red, ..." style continuation
    stop = text[len(text) // 2:len(text) // 2 + 4]
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=[stop], logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, logprobs=0),
              SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=[stop],
                             include_stop_str_in_output=True)]
    prompts = [PROMPTS[1], PROMPTS[0], PROMPTS[1]]
    want = generate_checked(engine_base_llm, prompts, params)
    assert want[0].outputs[0].stop_reason == stop
    llm = make_engine_llm(speculative_config=ngram(6))
    got = generate_checked(llm, prompts, params)
    assert_same(got, want, "stop strings")
    assert [o.outputs[0].stop_reason for o in got] == [o.outputs[0].stop_reason for o in want]
    assert len(got[1].outputs[0].token_ids) == 7


def test_seeded_sampling_with_ngram_equals_no_speculation(engine_base_llm, make_engine_llm):
    # A one-hot drafter is verified by drawing the target's own token at each position with
    # that position's seeded noise: the tokens are those of sampling without speculation.
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=s, max_tokens=MAX_TOKENS,
                             ignore_eos=True) for s in (11, 12, 13, 14)]
    want = generate_checked(engine_base_llm, PROMPTS, params)
    llm = make_engine_llm(speculative_config=ngram(4))
    got = generate_checked(llm, PROMPTS, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert llm.engine.get_stats().spec_decode_num_accepted_tokens > 0


def test_seeded_sampling_with_a_sampling_drafter_is_reproducible(make_engine_llm, tiny_drafter):
    config = {"method": "draft_model", "num_speculative_tokens": 3, "model": None}
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    llm = make_engine_llm(speculative_config=config)
    alone = generate_checked(llm, [PROMPTS[0]], params)[0].outputs[0].token_ids
    batched = generate_checked(llm, [PROMPTS[2], PROMPTS[0], PROMPTS[3]], params)
    assert batched[1].outputs[0].token_ids == alone


@pytest.mark.parametrize("config", [ngram(3), {"method": "draft_model",
                                               "num_speculative_tokens": 3}])
def test_disaggregated_decode_engine_speculates_after_the_handoff(engine_base_llm, baseline,
                                                                  config):
    """In process, as the workers do it: a prefill engine samples the first token, its prompt
    KV is copied into a `DisaggDecodeEngine` with speculation on (the draft model catches up
    on the prompt it never saw), which must continue with the colocated tokens."""
    base = engine_base_llm.engine
    prompt = list(baseline[1].prompt_token_ids)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    final, decode = run_handoff(base, base, prompt, params, max_steps=4 * MAX_TOKENS, seed=3,
                                speculative_config=config)
    assert final.token_ids == baseline[1].outputs[0].token_ids
    assert decode.get_stats().spec_decode_num_accepted_tokens > 0
