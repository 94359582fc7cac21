"""Hostile frames on a running server's real sockets: a stray local process connects raw ZMQ
PUSH / DEALER sockets to the colocated engine's report endpoint, and to every TCP port of a
P1/D1 cluster (the front's worker ROUTERs, where an unproven connection is read only as a
hello, and the prefill worker's KV server), and sends
garbage, truncated, foreign-key, forged, replayed, wrongly typed, multi-part and pickled
frames. Every one is dropped and counted in deepinfer:wire_frames_dropped_total by channel
and reason, nothing is unpickled, and a request in flight meanwhile (and one after) returns
the offline engine's greedy tokens."""
from __future__ import annotations

import os
import threading
import time

import httpx
import pytest
import zmq

from deepinfer.sampling_params import SamplingParams
from deepinfer.wire.secret import SECRET_ENV, derive_key
from tests.integration.serve_process import (SMALL_SERVER_ARGS, running_server,
                                             scrape_metrics)
from tests.integration.wire_attacks import Attacker, hostile_frames, ipc_endpoints, \
    tcp_listeners

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

SECRET = "wire-test-secret-" + os.urandom(8).hex()
PROMPT = "Once upon a time, in a land far away, there lived a king who"
DROPPED = "deepinfer:wire_frames_dropped_total"


def _drops(url: str) -> dict[tuple[str, str], float]:
    out = {}
    for key, value in scrape_metrics(url).items():
        if key.startswith(DROPPED + "{"):
            labels = dict(part.split("=", 1) for part in key[len(DROPPED) + 1:-1].split(","))
            out[(labels["channel"].strip('"'), labels["reason"].strip('"'))] = value
    return out


def _wait_drops(url: str, wanted: set[tuple[str, str]], timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        drops = _drops(url)
        if wanted <= {k for k, v in drops.items() if v > 0} or time.monotonic() > deadline:
            return drops
        time.sleep(0.3)


class _Completion(threading.Thread):
    """One greedy streamed completion, run while the attack goes on."""

    def __init__(self, url: str, prompt_ids: list[int], max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.prompt_ids, self.max_tokens = url, prompt_ids, max_tokens
        self.token_ids: list[int] | None = None
        self.error: Exception | None = None

    def run(self) -> None:
        try:
            model = httpx.get(f"{self.url}/v1/models", timeout=10).json()["data"][0]["id"]
            r = httpx.post(f"{self.url}/v1/completions", timeout=120, json={
                "model": model, "prompt": self.prompt_ids, "max_tokens": self.max_tokens,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True})
            r.raise_for_status()
            self.token_ids = r.json()["choices"][0]["token_ids"]
        except Exception as exc:  # reported by the test
            self.error = exc


def _reference(engine_base_llm, ids: list[int], max_tokens: int) -> list[int]:
    out = engine_base_llm.generate([{"prompt_token_ids": ids}], SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)[0]
    return list(out.outputs[0].token_ids)


def _attack_during_request(server, engine_base_llm, attack, max_tokens: int = 24):
    ids = engine_base_llm.get_tokenizer()(PROMPT).input_ids
    want = _reference(engine_base_llm, ids, max_tokens)
    request = _Completion(server.url, ids, max_tokens)
    request.start()
    attacker = Attacker()
    try:
        attack(attacker)
    finally:
        attacker.close()
    request.join(120)
    assert request.error is None and request.token_ids == want
    after = _Completion(server.url, ids, max_tokens)  # the receive loops still serve
    after.run()
    assert after.error is None and after.token_ids == want
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


ALL_REASONS = {"truncated", "version", "key", "mac", "type", "replay", "decode"}


def test_colocated_engine_channel_drops_hostile_frames(engine_base_llm, tmp_path):
    marker = tmp_path / "pwned"
    with running_server(*SMALL_SERVER_ARGS, env={SECRET_ENV: SECRET}) as server:
        endpoints = ipc_endpoints(server.proc.pid, "output")
        assert endpoints, "the engine's report endpoint was not found"
        channel = f"engine.output@{endpoints[0]}"
        frames = hostile_frames(channel, str(marker), derive_key(SECRET))

        def attack(attacker):
            for _ in range(3):
                attacker.send(zmq.PUSH, endpoints[0], [[f] for _, f in frames])

        _attack_during_request(server, engine_base_llm, attack)
        drops = _wait_drops(server.url, {("engine.output", r) for r in ALL_REASONS})
        for reason in ALL_REASONS:
            assert drops.get(("engine.output", reason), 0) >= 1, (reason, drops)
        assert drops[("engine.output", "truncated")] >= 6  # 2 per round, 3 rounds
        assert drops[("engine.output", "replay")] >= 3
    assert not marker.exists()


def test_p1_d1_cluster_sockets_drop_hostile_frames(engine_base_llm, tmp_path):
    marker = tmp_path / "pwned"
    with running_server("--dtype", "float32", "--threads", "1", "--num-kv-blocks", "128",
                        "--max-model-len", "256", "--prefill-workers", "1",
                        "--decode-workers", "1", env={SECRET_ENV: SECRET}) as server:
        endpoints = tcp_listeners(server.proc.pid, exclude_ports={server.port})
        assert len(endpoints) >= 4, endpoints  # report ROUTER, 2 worker inputs, KV ROUTER
        key = derive_key(SECRET)

        def attack(attacker):
            for endpoint in endpoints:
                for kind in ("worker.hello", "kv.pull"):
                    frames = hostile_frames(f"{kind}@{endpoint}", str(marker), key)
                    attacker.send(zmq.PUSH, endpoint, [[f] for _, f in frames])
                    attacker.send(zmq.DEALER, endpoint, [[f] for _, f in frames])
                # the frame that used to kill the KV server thread: two parts
                attacker.send(zmq.DEALER, endpoint, [[b"a", b"b"], [b"x"] * 5])

        _attack_during_request(server, engine_base_llm, attack)
        wanted = {("worker.hello", r) for r in ALL_REASONS | {"frames"}} | \
            {("kv.pull", r) for r in ALL_REASONS | {"frames"}}
        drops = _wait_drops(server.url, wanted)
        for channel, reason in sorted(wanted):
            assert drops.get((channel, reason), 0) >= 1, (channel, reason, drops)
    assert not marker.exists()
