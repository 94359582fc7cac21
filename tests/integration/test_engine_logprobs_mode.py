"""--logprobs-mode on the real model: by default (raw_logprobs, vLLM's default) a request's
logprobs are transformers' log-softmax of the unprocessed logits, whatever its penalties and
logit_bias; processed_logprobs applies them; the tokens are the same in both modes; and
speculative decoding reports the same logprobs as plain decoding in both modes."""
from __future__ import annotations

import pytest
import torch

from deepinfer import SamplingParams
from tests.integration.engine_checks import generate_checked

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPT = "Repeat after me: red, green, blue, red, green, blue, red, green,"
K = 4
TOL = 2e-3


def penalised(prompt_ids: list[int]) -> SamplingParams:
    """Greedy, with additive penalties and a bias on a token the model likes here (so the
    processed numbers differ a lot from the raw ones)."""
    return SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=K,
                          frequency_penalty=0.9, presence_penalty=0.6,
                          logit_bias={prompt_ids[-1]: 5.0, prompt_ids[-2]: -3.0})


def processed_reference(raw_logprobs: torch.Tensor, params: SamplingParams, output: list[int]
                        ) -> torch.Tensor:
    """log_softmax of the processed logits, from the raw log-softmax: logit_bias and the
    frequency / presence penalties only shift logits, so log_softmax(raw) can stand for raw."""
    out = []
    for step, row in enumerate(raw_logprobs):
        values = row.clone()
        for token, bias in params.logit_bias.items():
            values[token] += bias
        counts = torch.bincount(torch.tensor(output[:step], dtype=torch.long),
                                minlength=values.shape[0]).float()
        values -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
        out.append(torch.log_softmax(values, -1))
    return torch.stack(out)


def check(lps, token_ids, want: torch.Tensor) -> None:
    assert len(lps) == len(token_ids)
    for step, (lp, token) in enumerate(zip(lps, token_ids)):
        assert lp.token_id == token
        assert abs(lp.logprob - float(want[step, token])) < TOL, f"step {step}"
        for t, v in zip(lp.top_token_ids, lp.top_logprobs):
            assert abs(v - float(want[step, t])) < TOL, f"step {step} token {t}"
        assert min(float(want[step, t]) for t in lp.top_token_ids) >= \
            float(want[step].topk(K).values[-1]) - TOL


@pytest.fixture(scope="module")
def raw_run(engine_base_llm, hf_reference):
    prompt_ids = hf_reference.encode(PROMPT)
    params = penalised(prompt_ids)
    out = generate_checked(engine_base_llm, [{"prompt_token_ids": prompt_ids}], params)[0]
    ref = hf_reference.score(prompt_ids, out.outputs[0].token_ids)  # teacher-forced: every step
    return prompt_ids, params, out.outputs[0], ref


def test_raw_logprobs_are_the_models(raw_run):
    _, _, c, ref = raw_run
    check(c.logprobs, c.token_ids, ref.logprobs)
    assert c.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in c.logprobs), abs=1e-3)


@pytest.fixture(scope="module")
def processed_llm(make_engine_llm):
    return make_engine_llm(logprobs_mode="processed_logprobs")


@pytest.fixture(scope="module")
def processed_run(processed_llm, raw_run):
    prompt_ids, params, _, _ = raw_run
    return generate_checked(processed_llm, [{"prompt_token_ids": prompt_ids}],
                            params)[0].outputs[0]


@pytest.fixture(scope="module")
def spec_llms(make_engine_llm):
    """One ngram-speculating engine per mode."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}
    return {mode: make_engine_llm(logprobs_mode=mode, speculative_config=spec)
            for mode in ("raw_logprobs", "processed_logprobs")}


def test_processed_logprobs_apply_the_penalties(raw_run, processed_run):
    _, params, raw_choice, ref = raw_run
    c = processed_run
    assert list(c.token_ids) == list(raw_choice.token_ids)  # the mode never changes tokens
    want = processed_reference(ref.logprobs, params, list(c.token_ids))
    check(c.logprobs, c.token_ids, want)
    # The bias and penalties really moved the numbers (else this shows nothing).
    assert max(abs(a.logprob - b.logprob) for a, b in zip(c.logprobs, raw_choice.logprobs)) > 0.1


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_speculation_reports_the_plain_logprobs(spec_llms, raw_run, processed_run, mode):
    prompt_ids, params, raw_choice, _ = raw_run
    plain = raw_choice if mode == "raw_logprobs" else processed_run
    llm = spec_llms[mode]
    got = generate_checked(llm, [{"prompt_token_ids": prompt_ids}], params)[0].outputs[0]
    assert llm.engine.get_stats().spec_decode_num_accepted_tokens > 0
    assert list(got.token_ids) == list(plain.token_ids)
    for a, b in zip(got.logprobs, plain.logprobs):
        assert a.token_id == b.token_id and a.top_token_ids == b.top_token_ids
        assert abs(a.logprob - b.logprob) < 1e-4


def test_disaggregated_decode_reports_in_its_mode(processed_llm, engine_base_llm, raw_run,
                                                  processed_run):
    """The decode worker's engine takes the mode from its EngineConfig: after the handoff its
    logprobs are the plain engine's in that mode (the prefill worker's first token aside)."""
    from tests.integration.engine_checks import run_handoff
    prompt_ids, params, _, _ = raw_run
    plain = processed_run  # not the default mode: a decode side that ignored it would differ
    handed, _ = run_handoff(processed_llm.engine, engine_base_llm.engine, prompt_ids, params,
                            logprobs_mode="processed_logprobs")
    assert list(handed.token_ids) == list(plain.token_ids)
    assert len(handed.logprobs) == len(plain.logprobs) - 1  # the handoff sent no first logprob
    for a, b in zip(handed.logprobs, plain.logprobs[1:]):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4


def test_stop_token_ids_cut_speculated_tokens_where_plain_decoding_stops(
        engine_base_llm, spec_llms, hf_reference):
    """A stop token among accepted drafts ends the output there, with plain decoding's tokens,
    text, finish and stop reasons (the drafts after it are dropped)."""
    prompt = [{"prompt_token_ids": hf_reference.encode(PROMPT)}]
    free = generate_checked(engine_base_llm, prompt, SamplingParams(
        temperature=0.0, max_tokens=16, ignore_eos=True))[0].outputs[0].token_ids
    # A token first seen well into the output (the step that emits it likely accepted drafts).
    stop_at = next(j for j in range(4, len(free)) if free[j] not in free[:j])
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1,
                            stop_token_ids=[free[stop_at]])
    plain = generate_checked(engine_base_llm, prompt, params)[0].outputs[0]
    assert list(plain.token_ids) == list(free[:stop_at + 1]) and plain.finish_reason == "stop"
    llm = spec_llms["raw_logprobs"]
    accepted = llm.engine.get_stats().spec_decode_num_accepted_tokens
    got = generate_checked(llm, prompt, params)[0].outputs[0]
    assert llm.engine.get_stats().spec_decode_num_accepted_tokens > accepted
    assert list(got.token_ids) == list(plain.token_ids) and got.text == plain.text
    assert (got.finish_reason, got.stop_reason) == (plain.finish_reason, plain.stop_reason)
    assert [lp.token_id for lp in got.logprobs] == list(plain.token_ids)
