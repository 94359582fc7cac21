"""A step that raises fails only what it must.

Engine level: a fault injected for one request (`DebugStepFault`, a runner error for one
request id) fails that request alone; the requests batched with it, including one that hit
the faulty request's freshly scheduled prefix blocks in the same step, finish with exactly
their fault-free greedy output and no block leaks. A fault pinned on no single request fails
every request in flight with a clear error and the engine keeps serving; one that never goes
away makes the engine raise after MAX_FAILED_STEPS_IN_ROW (its process is then restarted).
Over HTTP: the same injected fault in a real `deepinfer serve` answers the faulty request
with a clear 500 while concurrent requests stream their correct output, the engine process
is not restarted, and /metrics counts the failure.
"""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from deepinfer import SamplingParams
from deepinfer.engine.llm_engine import MAX_FAILED_STEPS_IN_ROW
from deepinfer.engine.step_faults import DebugStepFault
from tests.integration.engine_checks import assert_engine_idle, token_prompts
from tests.integration.serve_process import (
    SMALL_SERVER_FAULT_SEED, OfflineReference, metric, scrape_metrics,
)

FAULT_SEED = 31337
SHARED = [300 + i for i in range(32)]  # two full blocks of 16 shared by two prompts
PROMPT_A = [504, 2365, 282, 4649, 314]
PROMPT_B = SHARED + [11, 12, 13]
PROMPT_C = SHARED + [21, 22, 23, 24]  # the faulty request
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def fault_llm(make_engine_llm):
    llm = make_engine_llm(kv_cache_memory="64MiB")
    llm.engine.isolate_step_faults = True
    return llm


def reference(llm, prompts):
    outputs = llm.generate(token_prompts(prompts), GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.kv.pool.reset_prefix_cache()  # no hits on these later
    return [o.outputs[0].token_ids for o in outputs]


def run_until_idle(engine, max_steps: int = 200) -> dict:
    done = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return done
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output.outputs[0].token_ids
        engine.scheduler.check_invariants()
    raise AssertionError("the engine did not finish")


@pytest.mark.slow
def test_fault_pinned_on_one_request_leaves_the_others_exact(fault_llm):
    engine = fault_llm.engine
    want_a, want_b = reference(fault_llm, [PROMPT_A, PROMPT_B])
    engine.debug_fault = DebugStepFault(FAULT_SEED)
    try:
        engine.add_request("a", PROMPT_A, GREEDY)
        engine.step()  # "a" is a running decode when the faulty request arrives
        # C is scheduled before B in one step: B hits C's new prefix blocks (computed in that
        # step), which the failed step left unwritten.
        engine.add_request("c", PROMPT_C, SamplingParams(temperature=0.0, max_tokens=4,
                                                         seed=FAULT_SEED))
        engine.add_request("b", PROMPT_B, GREEDY)
        done = run_until_idle(engine)
    finally:
        engine.debug_fault = DebugStepFault(None)
    failures = engine.take_request_failures()
    assert [(f.request_id, f.engine_fault) for f in failures] == [("c", False)]
    assert "injected fault for request c" in failures[0].message
    assert done == {"a": want_a, "b": want_b}
    assert engine.num_failed_steps >= 1
    assert_engine_idle(fault_llm)


@pytest.mark.slow
def test_output_processing_fault_fails_only_its_request(fault_llm):
    engine = fault_llm.engine
    (want_a,) = reference(fault_llm, [PROMPT_A])
    engine.add_request("a", PROMPT_A, GREEDY)
    engine.add_request("bad", PROMPT_B, GREEDY)

    def broken_detokenizer(*args, **kwargs):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

    engine._states["bad"].sequences["bad"].detokenizer.add_tokens = broken_detokenizer
    done = run_until_idle(engine)
    failures = engine.take_request_failures()
    assert [(f.request_id, f.engine_fault) for f in failures] == [("bad", False)]
    assert "UnicodeDecodeError" in failures[0].message
    assert done == {"a": want_a}
    assert_engine_idle(fault_llm)


@pytest.mark.slow
def test_unpinned_fault_fails_all_in_flight_and_the_engine_keeps_serving(fault_llm,
                                                                          monkeypatch):
    engine = fault_llm.engine
    (want_a,) = reference(fault_llm, [PROMPT_A])
    execute = engine.runner.execute
    calls = []

    def broken(output):  # fails whatever runs: no request is to blame
        calls.append(output)
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "execute", broken)
    engine.add_request("x", PROMPT_A, GREEDY)
    engine.add_request("y", PROMPT_B, GREEDY)
    assert engine.step() == []
    failures = engine.take_request_failures()
    assert sorted((f.request_id, f.engine_fault) for f in failures) == [("x", True),
                                                                        ("y", True)]
    assert "RuntimeError: device lost" in failures[0].message
    assert not engine.has_unfinished_requests()
    assert_engine_idle(fault_llm)

    monkeypatch.setattr(engine.runner, "execute", execute)
    engine.add_request("z", PROMPT_A, GREEDY)
    assert run_until_idle(engine) == {"z": want_a}
    assert engine.take_request_failures() == []

    # A fault that never goes away: the engine gives up (and its process is restarted).
    monkeypatch.setattr(engine.runner, "execute", broken)
    with pytest.raises(RuntimeError, match="device lost"):
        for i in range(MAX_FAILED_STEPS_IN_ROW + 1):
            engine.add_request(f"w{i}", PROMPT_A, GREEDY)
            engine.step()
    assert i == MAX_FAILED_STEPS_IN_ROW  # the steps before were recovered from
    assert len(engine.take_request_failures()) == MAX_FAILED_STEPS_IN_ROW
    engine.abort_request([f"w{i}"])  # (its process would exit now)
    assert engine.scheduler.kv.pool.reset_prefix_cache()


# --- over HTTP --------------------------------------------------------------------------------

LONG = {"prompt": PROMPT_A, "max_tokens": 12, "ignore_eos": True, "temperature": 0,
        "return_token_ids": True}


async def _stream(http, body: dict, started: asyncio.Event) -> tuple[list[int], list[dict]]:
    token_ids, events = [], []
    async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            events.append(event)
            for choice in event.get("choices", []):
                token_ids += choice.get("token_ids") or []
                if token_ids:
                    started.set()
    return token_ids, events


async def _faulty_among_others(url: str) -> dict:
    """Two greedy streams decoding; then the faulty request, blocking and streamed."""
    faulty = {**LONG, "max_tokens": 4, "seed": SMALL_SERVER_FAULT_SEED}
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        started = asyncio.Event()
        others = [asyncio.create_task(_stream(http, LONG, started)) for _ in range(2)]
        await asyncio.wait_for(started.wait(), 120)
        blocking, (_, faulty_events) = await asyncio.gather(
            http.post("/v1/completions", json=faulty), _stream(http, faulty, asyncio.Event()))
        return {"faulty": (blocking.status_code, blocking.json()),
                "faulty_stream": faulty_events, "others": await asyncio.gather(*others)}


def _failures(samples: dict[str, float], reason: str) -> float:
    return sum(v for k, v in samples.items()
               if k.startswith("deepinfer:request_failures_total{") and f'reason="{reason}"' in k)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_injected_fault_over_http_fails_one_request_only(small_server, engine_base_llm):
    url = small_server.url
    expected = OfflineReference(engine_base_llm).generate(
        token_prompts([PROMPT_A]), SamplingParams(temperature=0.0, max_tokens=12,
                                                  ignore_eos=True))[0].outputs[0].token_ids
    before = scrape_metrics(url)
    pid = small_server.engine_pid()

    seen = asyncio.run(_faulty_among_others(url))

    status, body = seen["faulty"]
    assert status == 500 and body["error"]["code"] == "request_failed", body
    assert "injected fault" in body["error"]["message"]
    assert "other requests were not affected" in body["error"]["message"]
    assert seen["faulty_stream"][-1]["error"]["code"] == "request_failed", seen["faulty_stream"]
    for token_ids, events in seen["others"]:
        assert token_ids == expected
        assert events[-1]["choices"][0]["finish_reason"] == "length"
    after = scrape_metrics(url)
    assert _failures(after, "request") - _failures(before, "request") == 2
    assert metric(after, "deepinfer:engine_step_failures_total") >= \
        metric(before, "deepinfer:engine_step_failures_total") + 1
    assert metric(after, "deepinfer:engine_restarts_total") == \
        metric(before, "deepinfer:engine_restarts_total")
    assert small_server.engine_pid() == pid  # the engine process kept serving
    again = httpx.post(f"{url}/v1/completions", json=LONG, timeout=120).json()
    assert again["choices"][0]["token_ids"] == expected
