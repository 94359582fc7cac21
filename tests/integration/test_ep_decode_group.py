"""An expert-parallel group as the disaggregated decode stage, as a user runs it:
`deepinfer serve --prefill-workers 1 --decode-workers 1 --decode-data-parallel-size 4
--enable-expert-parallel --enable-eplb`. The prefill worker hands KV to the rank the decode
router picked; the 4 ranks step in lockstep for the MoE collectives. Over HTTP: greedy outputs
of tiny DeepSeek-V3 equal one plain process while EPLB rebalances every 3 group steps
(mid-generation), and the rebalances are on /metrics per decode group; a rank killed under load
takes its group out at once (no hung request), and the group is restarted as a whole and serves
correctly again. (Tiny Qwen3-MoE over EP ranks: test_expert_parallel_equality.py.)"""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import openai
import pytest

from deepinfer import SamplingParams
from deepinfer.engine.step_faults import DEBUG_FAULT_SEED_ENV
from tests.integration.expert_parallel_harness import one_process_outputs, write_checkpoint
from tests.integration.moe_checkpoints import random_prompts
from tests.integration.serve_process import ADMIN_FLAGS, ADMIN_HEADERS, ServeProcess, scrape_metrics

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

RANKS = 4
EPLB = {"window_size": 4, "step_interval": 3, "num_redundant_experts": 4}
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = random_prompts(seed=9, lengths=(3, 17, 40, 9, 25, 5, 12, 30))
FAULT_SEED = 4243  # decode ranks fail any step that runs a request with this seed


def start_server(directory: str, *flags: str, env: dict | None = None) -> ServeProcess:
    server = ServeProcess("--model", directory, "--dtype", "float32", "--threads", "1",
                          "--num-kv-blocks", "128", "--kv-store", "none",
                          "--prefill-workers", "1", "--decode-workers", "1",
                          "--decode-data-parallel-size", str(RANKS), "--enable-expert-parallel",
                          *ADMIN_FLAGS, *flags, env=env)
    try:
        server.wait_ready()
    except BaseException:
        server.stop()
        raise
    return server


def complete_all(url: str, prompts, stream: bool = False, timeout_s: float = 120,
                 seeds: dict[int, int] | None = None):
    """('ok', token ids) or ('error', message) per prompt, sent concurrently; every request
    must end (no hang) within `timeout_s`. `seeds`: prompt index -> sampling seed."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                           timeout=timeout_s)
    model = client.models.list().data[0].id
    results: dict[int, tuple] = {}

    def ask(i: int) -> None:
        body = {"ignore_eos": True, "return_token_ids": True}
        if seeds and i in seeds:
            body["seed"] = seeds[i]
        try:
            if stream:
                tokens = []
                for chunk in client.completions.create(
                        model=model, prompt=prompts[i], max_tokens=PARAMS.max_tokens,
                        temperature=0, stream=True, extra_body=body):
                    tokens += getattr(chunk.choices[0], "token_ids", None) or []
                results[i] = ("ok", tokens)
            else:
                reply = client.completions.create(model=model, prompt=prompts[i],
                                                  max_tokens=PARAMS.max_tokens, temperature=0,
                                                  extra_body=body)
                results[i] = ("ok", reply.choices[0].token_ids)
        except Exception as e:  # asserted by the caller
            results[i] = ("error", f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=ask, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 10)
    assert not any(t.is_alive() for t in threads), "a request hung"
    return [results[i] for i in range(len(prompts))]


def decode_workers(url: str) -> list[dict]:
    workers = httpx.get(f"{url}/admin/workers", headers=ADMIN_HEADERS, timeout=10).json()["workers"]
    return [w for w in workers if w["role"] == "decode"]


def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory, default_model_source):
    directory = write_checkpoint("deepseek_v3", tmp_path_factory.mktemp("ep_decode_ds"), seed=31,
                                 tokenizer=default_model_source.load_tokenizer())
    want = [tokens for tokens, _ in one_process_outputs(directory, PROMPTS, PARAMS)]
    server = start_server(directory, "--enable-eplb", "--eplb-config", json.dumps(EPLB),
                          env={DEBUG_FAULT_SEED_ENV: f"decode:{FAULT_SEED}"})
    try:
        yield server, want
    finally:
        assert server.stop() == 0, f"server did not stop cleanly:\n{server.output()}"


def test_deepseek_4_rank_decode_group_equals_one_process_across_rebalances(deepseek):
    server, want = deepseek
    assert [w["state"] for w in decode_workers(server.url)] == ["alive"] * RANKS
    got = complete_all(server.url, PROMPTS)
    assert got == [("ok", tokens) for tokens in want]
    samples = scrape_metrics(server.url)
    # The decode router spread the requests over every rank (each received KV).
    for rank in range(RANKS):
        received = [v for k, v in samples.items() if k.startswith("deepinfer:cluster_kv_transfers")
                    and f'worker_id="decode-{rank}"' in k]
        assert received and received[0] > 0, (rank, received)
    # EPLB rebalanced mid-generation (an idle group takes no steps) and moved experts; the
    # group's last rebalance is on /metrics under the colocated names.
    group = 'dp_group="0"'

    def value(name: str) -> float:
        found = [v for k, v in samples.items() if k.startswith(name + "{") and group in k]
        assert len(found) == 1, (name, found)
        return found[0]
    assert value("deepinfer:eplb_rebalances_total") >= 3
    assert value("deepinfer:eplb_moved_expert_bytes_total") > 0, "no expert moved"
    assert value("deepinfer:eplb_redundant_expert_bytes") > 0
    assert value("deepinfer:eplb_last_rebalance_seconds") > 0
    balance = {k: v for k, v in samples.items()
               if k.startswith("deepinfer:eplb_balancedness{") and group in k}
    num_layers = len([k for k in balance if 'phase="after"' in k])
    assert num_layers >= 1 and len(balance) == 2 * num_layers
    assert all(0 < v <= 1 for v in balance.values()), balance


def test_a_step_fault_on_a_decode_rank_fails_only_its_request(deepseek):
    """The rank fails the request (lockstep agreement, ep/lockstep_faults.py); the requests on
    it and on the other ranks finish exactly, and the group is not restarted."""
    server, want = deepseek
    pids = [w["placement"]["pid"] for w in decode_workers(server.url)]
    got = complete_all(server.url, PROMPTS + [PROMPTS[2]], seeds={len(PROMPTS): FAULT_SEED})
    assert got[:-1] == [("ok", tokens) for tokens in want]
    assert got[-1][0] == "error" and "injected fault" in got[-1][1], got[-1]
    workers = decode_workers(server.url)
    assert [w["state"] for w in workers] == ["alive"] * RANKS
    assert [w["placement"]["pid"] for w in workers] == pids


def test_rank_killed_under_load_no_hang_group_restarts(deepseek):
    server, want = deepseek
    results: list = []
    load = threading.Thread(target=lambda: results.extend(
        complete_all(server.url, PROMPTS * 2, stream=True)), daemon=True)
    load.start()
    wait_until(lambda: all(w["num_requests"] > 0 for w in decode_workers(server.url)), 60,
               "every rank holding requests")
    victim = decode_workers(server.url)[1]
    os.kill(victim["placement"]["pid"], signal.SIGKILL)
    load.join(180)
    assert not load.is_alive(), "requests hung after a rank was killed"
    for (status, value), ref in zip(results, want * 2):
        if status == "ok":
            assert value == ref  # unaffected requests (decoded before, or retried) are exact
        else:  # a clear error: the group's loss (naming the killed rank), or no group left
            killed = victim["worker_id"]
            assert (f"decode group 0 lost: {killed}" in value
                    or f"decode worker {killed} was lost" in value
                    or "no decode worker available" in value), value
    assert any(status == "error" for status, _ in results), "the kill interrupted nothing"
    # The group went out as a whole and comes back as a whole (new processes).
    wait_until(lambda: [w["state"] for w in decode_workers(server.url)] == ["alive"] * RANKS,
               180, "the group restarted")
    assert decode_workers(server.url)[1]["placement"]["pid"] != victim["placement"]["pid"]
    assert complete_all(server.url, PROMPTS[:3]) == [("ok", tokens) for tokens in want[:3]]
