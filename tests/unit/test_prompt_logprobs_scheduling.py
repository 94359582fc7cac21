"""Prompt log-probs in the scheduler and the completions endpoint (no model): every prompt
position after the first is predicted exactly once per computation of the prompt, however it
is chunked; a request asking for them never takes a prefix-cache hit (a cached block has no
logits) while others do; the endpoint passes the field on and refuses it when streaming."""
from __future__ import annotations

import pytest

from deepinfer.core.kv_cache_manager import KVCacheManager
from deepinfer.core.request import Request
from deepinfer.core.scheduler import Scheduler, SchedulerConfig
from deepinfer.core.scheduler_output import StepResult
from deepinfer.core.step_budget import TokenBudgetPolicy
from deepinfer.sampling_params import SamplingParams
from deepinfer.server.serving_completion import OpenAIServingCompletion
from tests.unit.test_api_request_fields import error, make, prepare_completion

BLOCK = 4


def scheduler(budget: int) -> Scheduler:
    return Scheduler(SchedulerConfig(8, 256, True), KVCacheManager(64, BLOCK),
                     TokenBudgetPolicy(budget))


def run(sched: Scheduler, now: float = 0.0) -> dict[str, list]:
    """Step until idle; per request, the chunks' (first position, targets)."""
    seen: dict[str, list] = {}
    for step in range(100):
        out = sched.schedule(now + step)
        if out.is_empty and not sched.has_unfinished_requests():
            return seen
        for s in out.scheduled:
            if s.prompt_logprob_token_ids is not None:
                assert s.num_output_tokens == 0
                assert len(s.prompt_logprob_token_ids) <= s.num_new_tokens
                seen.setdefault(s.request_id, []).append(
                    (s.num_computed_tokens + 1, s.prompt_logprob_token_ids))
        sched.update(out, StepResult({s.request_id: 7 for s in out.scheduled if s.sample}))
        sched.check_invariants()
    raise AssertionError("did not finish")


@pytest.mark.parametrize("budget", [3, 5, 16, 64])
def test_every_prompt_position_is_predicted_once(budget):
    prompt = list(range(10, 31))  # 21 tokens
    sched = scheduler(budget)
    sched.add_request(Request("a", prompt, SamplingParams(max_tokens=3, prompt_logprobs=1)))
    sched.add_request(Request("b", prompt[:9], SamplingParams(max_tokens=3)))
    chunks = run(sched)["a"]
    positions = [p + i for p, targets in chunks for i in range(len(targets))]
    assert positions == list(range(1, len(prompt)))
    assert [t for _, targets in chunks for t in targets] == prompt[1:]
    assert "b" not in run(sched)


def test_requests_asking_for_prompt_logprobs_skip_the_prefix_cache():
    prompt = list(range(40, 57))  # 17 tokens: four full blocks
    sched = scheduler(64)
    sched.add_request(Request("warm", prompt, SamplingParams(max_tokens=1)))
    run(sched)
    sched.add_request(Request("hit", prompt, SamplingParams(max_tokens=1)))
    sched.add_request(Request("lps", prompt, SamplingParams(max_tokens=1, prompt_logprobs=0)))
    chunks = run(sched, now=200.0)
    assert sched.requests.get("hit") is None  # finished
    assert chunks["lps"][0][0] == 1 and len(chunks["lps"][0][1]) == len(prompt) - 1
    assert sched.kv.num_prefix_hits == 16  # "hit" reused four blocks, "lps" none


def test_single_token_prompt_has_nothing_to_predict():
    sched = scheduler(8)
    sched.add_request(Request("one", [5], SamplingParams(max_tokens=2, prompt_logprobs=3)))
    assert run(sched) == {}


def test_completions_pass_prompt_logprobs_and_refuse_them_streamed():
    completion = make(OpenAIServingCompletion)
    _, params = prepare_completion(completion, prompt_logprobs=4)
    assert params.prompt_logprobs == 4
    _, params = prepare_completion(completion)
    assert params.prompt_logprobs is None
    e = error(prepare_completion, completion, prompt_logprobs=1, stream=True)
    assert e.info.param == "prompt_logprobs" and "stream" in e.info.message
