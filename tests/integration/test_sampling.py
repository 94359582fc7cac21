"""Sampling semantics of the engine on the default model, vLLM-shaped:
seeds, top-k/top-p/min-p limits, stop strings and stop token ids, max/min tokens, ignore_eos,
n > 1, logprobs against the HF reference, and a bf16 engine against the fp32 reference."""
from __future__ import annotations

import pytest
import torch

from deepinfer import SamplingParams
from tests.integration.engine_checks import (chat_checked, generate_checked, run_handoff,
                                             token_prompts)
from tests.integration.hf_reference import assert_matches_reference
from tests.integration.prompt_corpus import distinct_prompts

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CONTINUATION_PROMPT = ("The old harbour town woke slowly. Fishing boats came in with the tide, "
                       "gulls circled the market, and the baker on the corner")
SHORT_ANSWER_CHAT = [{"role": "user", "content": "Say only: yes"}]


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


@pytest.fixture(scope="module")
def continuation(engine_base_llm):
    """Greedy continuation (32 tokens, EOS ignored) of a prompt that does not end quickly."""
    return generate_checked(engine_base_llm, [CONTINUATION_PROMPT],
                            greedy(32, ignore_eos=True))[0].outputs[0]


@pytest.fixture(scope="module")
def short_answer(engine_base_llm):
    """Greedy chat answer that ends with EOS after a few tokens."""
    out = chat_checked(engine_base_llm, SHORT_ANSWER_CHAT, greedy(32))[0].outputs[0]
    assert out.finish_reason == "stop" and 1 <= len(out.token_ids) < 10, (
        f"precondition: expected a short answer ending in EOS, got {out.token_ids!r} "
        f"({out.finish_reason})")
    return out


def eos_token_ids(llm, short_answer) -> set[int]:
    return {llm.get_tokenizer().eos_token_id, short_answer.token_ids[-1]}


def test_same_seed_same_output_different_seeds_differ(engine_base_llm):
    def seeded(seed: int) -> SamplingParams:
        return SamplingParams(temperature=1.0, seed=seed, max_tokens=16, ignore_eos=True)

    prompt = CONTINUATION_PROMPT
    pair = generate_checked(engine_base_llm, [prompt, prompt], seeded(1234))
    again = generate_checked(engine_base_llm, ["Tell me a story.", prompt], seeded(1234))
    tokens = [list(o.outputs[0].token_ids) for o in (*pair, again[1])]
    # Reproducible per request, whatever else shares the batch.
    assert tokens[0] == tokens[1] == tokens[2]
    others = [list(generate_checked(engine_base_llm, [prompt], seeded(s))[0].outputs[0].token_ids)
              for s in (1, 2, 3)]
    assert len({tuple(t) for t in others + [tokens[0]]}) >= 3, "different seeds gave one output"


@pytest.mark.parametrize("limit", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}],
                         ids=["top_k=1", "top_p~0", "min_p=1"])
def test_sampling_limited_to_top_token_equals_greedy(engine_base_llm, continuation, limit):
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=32, ignore_eos=True, **limit)
    out = generate_checked(engine_base_llm, [CONTINUATION_PROMPT], params)[0].outputs[0]
    assert list(out.token_ids) == list(continuation.token_ids)


def test_stop_string_cuts_text(engine_base_llm, continuation):
    text = continuation.text
    words = text.split()
    assert len(words) >= 6, f"precondition: continuation too short: {text!r}"
    stop = " " + words[4]
    cut = text.find(stop)
    assert cut > 0
    params = greedy(32, ignore_eos=True, stop=[stop])
    out = generate_checked(engine_base_llm, [CONTINUATION_PROMPT], params)[0].outputs[0]
    assert out.text == text[:cut], f"stop {stop!r}: got {out.text!r}, want {text[:cut]!r}"
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop
    assert len(out.token_ids) < len(continuation.token_ids)
    assert list(out.token_ids) == list(continuation.token_ids[:len(out.token_ids)])

    params = greedy(32, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    out = generate_checked(engine_base_llm, [CONTINUATION_PROMPT], params)[0].outputs[0]
    assert out.text == text[:cut + len(stop)]


def test_stop_token_ids(engine_base_llm, continuation):
    tokens = list(continuation.token_ids)
    k = next(i for i in range(3, len(tokens)) if tokens[i] not in tokens[:i])
    params = greedy(32, ignore_eos=True, stop_token_ids=[tokens[k]])
    out = generate_checked(engine_base_llm, [CONTINUATION_PROMPT], params)[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.stop_reason == tokens[k]
    # As in vLLM: the stop token ends token_ids, its text is not in the output text.
    assert list(out.token_ids) == tokens[:k + 1]
    tok = engine_base_llm.get_tokenizer()
    assert out.text == tok.decode(tokens[:k], skip_special_tokens=True)
    params = greedy(32, ignore_eos=True, stop_token_ids=[tokens[k]],
                    include_stop_str_in_output=True)
    out = generate_checked(engine_base_llm, [CONTINUATION_PROMPT], params)[0].outputs[0]
    assert out.text == tok.decode(tokens[:k + 1], skip_special_tokens=True)


def test_stop_string_waits_for_min_tokens(engine_base_llm, continuation):
    """vLLM's rule: a stop string ends nothing before min_tokens tokens."""
    text = continuation.text
    stop = " " + text.split()[4]
    assert text.count(stop) == 1, f"precondition: {stop!r} must occur once in {text!r}"
    params = greedy(32, ignore_eos=True, stop=[stop], min_tokens=32)
    out = generate_checked(engine_base_llm, [CONTINUATION_PROMPT], params)[0].outputs[0]
    assert out.finish_reason == "length" and out.stop_reason is None
    assert list(out.token_ids) == list(continuation.token_ids) and out.text == text


def test_max_tokens_gives_length(engine_base_llm, continuation):
    out = generate_checked(engine_base_llm, [CONTINUATION_PROMPT], greedy(5))[0].outputs[0]
    assert out.finish_reason == "length"
    assert list(out.token_ids) == list(continuation.token_ids[:5])


def test_eos_stops_and_ignore_eos_runs_to_max_tokens(engine_base_llm, short_answer):
    eos = eos_token_ids(engine_base_llm, short_answer)
    assert short_answer.token_ids[-1] in eos
    out = chat_checked(engine_base_llm, SHORT_ANSWER_CHAT,
                       greedy(20, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 20 and out.finish_reason == "length"
    # ignore_eos does not mask EOS: greedy still emits it at the same step, then goes on.
    assert list(out.token_ids[:len(short_answer.token_ids)]) == list(short_answer.token_ids)


def test_min_tokens_masks_eos(engine_base_llm, short_answer):
    eos = eos_token_ids(engine_base_llm, short_answer)
    min_tokens = len(short_answer.token_ids) + 5
    out = chat_checked(engine_base_llm, SHORT_ANSWER_CHAT,
                       greedy(40, min_tokens=min_tokens))[0].outputs[0]
    assert len(out.token_ids) >= min_tokens
    assert not eos & set(out.token_ids[:min_tokens]), f"EOS before min_tokens: {out.token_ids}"
    # Masking only changes the step where EOS would have been chosen.
    assert list(out.token_ids[:len(short_answer.token_ids) - 1]) == list(
        short_answer.token_ids[:-1])


def test_n_returns_n_completions(engine_base_llm, continuation):
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    out = generate_checked(engine_base_llm, [CONTINUATION_PROMPT], params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 12 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) >= 2, "n=3 sampled one sequence"

    out = generate_checked(engine_base_llm, [CONTINUATION_PROMPT], greedy(12, n=3,
                                                                           ignore_eos=True))[0]
    assert len(out.outputs) == 3
    for c in out.outputs:
        assert list(c.token_ids) == list(continuation.token_ids[:12])


def test_logprobs_match_hf(engine_base_llm, hf_reference):
    prompts = distinct_prompts(hf_reference.encode)[2:5]
    k = 5
    params = greedy(16, ignore_eos=True, logprobs=k)
    outputs = generate_checked(engine_base_llm, token_prompts(prompts), params)
    tol = 2e-3
    for out in outputs:
        c = out.outputs[0]
        ref = hf_reference.score(out.prompt_token_ids, c.token_ids)
        assert_matches_reference(ref, "logprobs")
        assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
        for step in range(ref.num_checked_tokens):
            lp, want = c.logprobs[step], ref.logprobs[step]
            assert lp.token_id == c.token_ids[step] and lp.rank == 1
            assert abs(lp.logprob - float(want[lp.token_id])) < tol
            assert len(lp.top_token_ids) == k and len(lp.top_logprobs) == k
            assert list(lp.top_logprobs) == sorted(lp.top_logprobs, reverse=True)
            for tok, value in zip(lp.top_token_ids, lp.top_logprobs):
                assert abs(value - float(want[tok])) < tol, f"step {step} token {tok}"
            kth_best = float(want.topk(k).values[-1])
            assert min(float(want[t]) for t in lp.top_token_ids) >= kth_best - tol
        assert c.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in c.logprobs),
                                                     abs=1e-3)

    plain = generate_checked(engine_base_llm, token_prompts(prompts[:1]), greedy(4))[0]
    assert plain.outputs[0].logprobs is None


def test_sampled_logprobs_are_consistent(engine_base_llm):
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True, logprobs=3)
    c = generate_checked(engine_base_llm, [CONTINUATION_PROMPT], params)[0].outputs[0]
    assert len(c.logprobs) == 12
    for tok, lp in zip(c.token_ids, c.logprobs):
        assert lp.token_id == tok and lp.logprob <= 0.0 and lp.rank >= 1
        assert len(lp.top_token_ids) == 3
        assert lp.logprob <= lp.top_logprobs[0] + 1e-5
        if lp.rank <= 3:
            assert lp.top_token_ids[lp.rank - 1] == tok


def test_bf16_engine_is_close_to_fp32_reference(hf_reference):
    from deepinfer import LLM
    llm = LLM(model=None, dtype="bfloat16", kv_cache_memory="128MiB", seed=0)
    assert next(llm.engine.model.parameters()).dtype == torch.bfloat16
    prompts = distinct_prompts(hf_reference.encode)[1:5]  # 9..90 tokens
    outputs = generate_checked(llm, token_prompts(prompts), greedy(8, ignore_eos=True))
    agreeing = []
    for out in outputs:
        c = out.outputs[0]
        assert len(c.token_ids) == 8 and c.text.strip()
        agreeing.append(hf_reference.score(out.prompt_token_ids, c.token_ids).num_agreeing_tokens)
    # bf16 rounding may flip close calls, but the first few tokens are mostly the fp32 ones.
    print(f"bf16 vs fp32 reference: agreeing prefix lengths {agreeing}")
    assert sum(a >= 1 for a in agreeing) >= 3, f"bf16 agreeing prefix lengths {agreeing}"
    assert sum(min(a, 4) for a in agreeing) >= 0.75 * 4 * len(agreeing), agreeing


def test_text_ending_inside_a_character_is_flushed(engine_base_llm):
    """A completion that ends inside a multi-byte character (here an emoji cut by max_tokens)
    keeps its last bytes: the text is the decode of every output token (it was empty)."""
    tok = engine_base_llm.get_tokenizer()
    chat = [{"role": "user", "content": "Reply with a single emoji."}]
    cut = 0
    for max_tokens in (1, 2, 3):
        out = chat_checked(engine_base_llm, chat, greedy(max_tokens))[0].outputs[0]
        want = tok.decode(out.token_ids, skip_special_tokens=True)
        assert out.text == want, f"max_tokens={max_tokens}: {out.text!r} != {want!r}"
        cut += want.endswith("\ufffd")
    assert cut >= 1, "precondition: no completion ended inside a character"


# ---- seeded sampling: the draw at output position i is a function of (seed, i) --------------
def sampled(seed: int, n: int = 1, max_tokens: int = 24) -> SamplingParams:
    return SamplingParams(n=n, temperature=1.0, seed=seed, max_tokens=max_tokens, ignore_eos=True)


def completions(outputs) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in out.outputs] for out in outputs]


def test_seeded_sampling_is_equal_alone_batched_and_preempted(engine_base_llm, make_engine_llm):
    encode = engine_base_llm.get_tokenizer().encode
    prompts = token_prompts(distinct_prompts(lambda t: encode(t, add_special_tokens=False))[:6])
    params = [sampled(1000 + 10 * i, n=2 if i == 0 else 1) for i in range(6)]
    alone = completions(generate_checked(engine_base_llm, prompts[:1], params[:1]))
    batched = completions(generate_checked(engine_base_llm, prompts, params))
    # 12 blocks of 16 tokens admit five of the seven sequences, whose growth (14 blocks) then
    # preempts decodes; they are recomputed and resume at the output position they had reached.
    tiny = make_engine_llm(num_kv_blocks=12, enable_prefix_caching=False)
    preempted = completions(generate_checked(tiny, prompts, params))
    assert tiny.engine.get_stats().num_preemptions > 0, "the tiny KV cache never preempted"
    assert alone[0] == batched[0]
    assert preempted == batched
    assert batched[0][0] != batched[0][1], "n=2 children drew one sequence"


def test_seeded_sampling_continues_across_the_prefill_decode_handoff(engine_base_llm,
                                                                     make_engine_llm):
    """The decode side must produce the colocated tokens: noise at position i is (seed, i)."""
    prompt = engine_base_llm.engine.tokenizer.encode(CONTINUATION_PROMPT, add_special_tokens=False)
    params = sampled(77, max_tokens=16)
    colocated = generate_checked(engine_base_llm, token_prompts([prompt]), params)[0].outputs[0]
    handed, _ = run_handoff(make_engine_llm(seed=5).engine, engine_base_llm.engine, prompt,
                            params, seed=123)
    assert list(handed.token_ids) == list(colocated.token_ids)
    assert handed.text == colocated.text


def test_stop_string_waits_for_min_tokens_after_the_handoff(engine_base_llm, make_engine_llm,
                                                            continuation):
    """The decode worker's detokenizer applies vLLM's min_tokens rule to stop strings too."""
    text = continuation.text
    stop = " " + text.split()[4]
    assert text.count(stop) == 1, f"precondition: {stop!r} must occur once in {text!r}"
    prompt = engine_base_llm.engine.tokenizer.encode(CONTINUATION_PROMPT, add_special_tokens=False)
    params = greedy(32, ignore_eos=True, stop=[stop], min_tokens=32)
    handed, _ = run_handoff(make_engine_llm(seed=5).engine, engine_base_llm.engine, prompt,
                            params, seed=123)
    assert handed.finish_reason == "length" and handed.stop_reason is None
    assert list(handed.token_ids) == list(continuation.token_ids) and handed.text == text
