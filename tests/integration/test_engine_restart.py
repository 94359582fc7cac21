"""The colocated engine heals itself: SIGKILL the engine process of a real `deepinfer serve`,
then requests in flight fail at once with a clear error, /health and new requests say 503
while the supervisor restarts it, and the new engine serves the same greedy output."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import psutil
import pytest

from deepinfer import SamplingParams
from deepinfer.clients.engine_supervisor import EngineRestartPolicy
from tests.integration.serve_process import (
    OfflineReference, metric, scrape_metrics, wait_for_metric,
)


PROMPT = [504, 2365, 282, 4649, 314]  # "The capital of France is" in token ids
LONG = {"prompt": [300] * 8, "max_tokens": 50, "ignore_eos": True, "temperature": 0}


async def _kill_engine_with_requests_in_flight(url: str, engine_pid: int) -> dict:
    """One streaming and one non-streaming request running; the engine is paused (so neither
    can finish) and then SIGKILLed. Returns what the clients and /health saw."""
    seen = {}
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        blocking = asyncio.create_task(http.post("/v1/completions", json=LONG))
        async with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.aiter_lines()
            async for line in lines:
                if line.startswith("data:"):
                    break
            await asyncio.to_thread(wait_for_metric, url, "deepinfer:num_requests_running",
                                    lambda v: v >= 2)
            os.kill(engine_pid, signal.SIGSTOP)
            assert not blocking.done()
            os.kill(engine_pid, signal.SIGKILL)
            seen["stream"] = [line async for line in lines if line.startswith("data:")]
        response = await blocking
        seen["blocking"] = (response.status_code, response.json()["error"])
        seen["health"] = (await http.get("/health")).status_code
        response = await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        seen["new"] = (response.status_code, response.json()["error"]["code"])
    return seen


def test_restart_backoff_doubles_up_to_its_cap():
    policy = EngineRestartPolicy(max_restarts=3, initial_backoff_s=1.0, max_backoff_s=5.0)
    assert [policy.backoff_s(k) for k in (1, 2, 3, 4, 10_000)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    with pytest.raises(ValueError):
        EngineRestartPolicy(max_restarts=-1)


def test_negative_max_engine_restarts_is_a_cli_error(capsys):
    from deepinfer.cli.main import main

    assert main(["serve", "--max-engine-restarts", "-1"]) == 2
    assert "--max-engine-restarts must be >= 0" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_killed_engine_is_restarted_and_serves_again(small_server, engine_base_llm):
    url = small_server.url
    expected = OfflineReference(engine_base_llm).generate(
        [{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0.0, max_tokens=8)
    )[0].outputs[0].token_ids
    restarts = metric(scrape_metrics(url), "deepinfer:engine_restarts_total")
    old_pid = small_server.engine_pid()

    seen = asyncio.run(_kill_engine_with_requests_in_flight(url, old_pid))

    # In flight: a clear error at once, not a hang.
    status, error = seen["blocking"]
    assert status == 500 and error["code"] == "engine_dead", error
    assert "SIGKILL" in error["message"] and "restarting" in error["message"]
    assert seen["stream"][-1] == "data: [DONE]"
    assert '"engine_dead"' in seen["stream"][-2] and "SIGKILL" in seen["stream"][-2]
    # Down: the supervisor backs off before restarting, and re-admits only once healthy.
    assert seen["health"] == 503
    assert seen["new"] == (503, "engine_unavailable")

    statuses = []
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        response = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "return_token_ids": True})
        statuses.append(response.status_code)
        if response.status_code != 503:
            break
        time.sleep(0.2)
    assert statuses[-1] == 200 and set(statuses[:-1]) <= {503}, (statuses, response.text)
    assert response.json()["choices"][0]["token_ids"] == expected
    assert httpx.get(f"{url}/health").status_code == 200
    assert metric(scrape_metrics(url), "deepinfer:engine_restarts_total") == restarts + 1
    assert small_server.engine_pid() != old_pid and not psutil.pid_exists(old_pid)


STALL_TIMEOUT_S = 5.0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_stopped_engine_is_noticed_killed_and_restarted(engine_base_llm):
    """SIGSTOP (the process lives, its loop does not advance): /health turns 503 within the
    stall timeout (+ the output loop's 0.5 s poll), the request in flight fails naming the
    stall, and the engine is killed and restarted to serve the same greedy tokens."""
    from tests.integration.serve_process import SMALL_SERVER_ARGS, running_server

    expected = OfflineReference(engine_base_llm).generate(
        [{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0.0, max_tokens=8)
    )[0].outputs[0].token_ids
    with running_server(*SMALL_SERVER_ARGS, "--loop-stall-timeout", str(STALL_TIMEOUT_S)) as server:
        url = server.url
        old_pid = server.engine_pid()

        async def stop_with_a_request_in_flight():
            async with httpx.AsyncClient(base_url=url, timeout=120) as http:
                blocking = asyncio.create_task(http.post("/v1/completions", json=LONG))
                await asyncio.to_thread(wait_for_metric, url, "deepinfer:num_requests_running",
                                        lambda v: v >= 1)
                os.kill(old_pid, signal.SIGSTOP)
                stopped = time.monotonic()
                while (await http.get("/health")).status_code == 200:
                    assert time.monotonic() - stopped < STALL_TIMEOUT_S + 10, "never noticed"
                    await asyncio.sleep(0.1)
                noticed = time.monotonic() - stopped
                health = (await http.get("/health")).json()
                response = await blocking
                return noticed, health, response.status_code, response.json()["error"]

        noticed, health, status, error = asyncio.run(stop_with_a_request_in_flight())
        assert STALL_TIMEOUT_S - 1 <= noticed <= STALL_TIMEOUT_S + 5, noticed
        assert health == {"status": "unavailable"}
        assert status == 500 and error["code"] == "engine_dead", error
        assert "did not advance" in error["message"] and "restarting" in error["message"]

        deadline = time.monotonic() + 180
        while httpx.get(f"{url}/health").status_code != 200:
            assert time.monotonic() < deadline, "not restarted"
            time.sleep(0.2)
        response = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "return_token_ids": True})
        assert response.json()["choices"][0]["token_ids"] == expected
        assert server.engine_pid() != old_pid and not psutil.pid_exists(old_pid)
