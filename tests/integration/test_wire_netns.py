"""Hostile frames across real network namespaces: a P1/D1 cluster (front and both workers) runs
in namespace "cluster" with every socket on its 10.x address (`--host`, `--cluster-host`); an
attacker process in namespace "attack" reaches it only over veth + bridge and throws garbage,
truncated, oversized, foreign-key, forged, replayed, wrongly typed, multi-part and pickled
frames at every listening TCP port while greedy requests run. The test process talks HTTP
through its own bridge port. Outputs must equal the same prompts' outputs before the attack,
no file may appear, drops are counted, the attacker's passive PULL / DEALER peers receive not
one frame (worker inputs are ROUTERs that send only to a proven worker), and the server still
answers.

Then, on the same cluster, a cut and heal: every TCP packet of the decode worker process is
dropped (iptables in the namespace, netns_cut.py) while it streams; the front suspends it
after --heartbeat-timeout, /health is 503, the stream ends with an error naming it and new
requests get 503 at once; the rules deleted, the same process is back in routing and answers
as before the cut."""
from __future__ import annotations

import threading
import time

import httpx
import psutil
import pytest

from tests.integration.netns import NetnsTopology, require_netns
from tests.integration.netns_cut import PortCut, local_ports, require_iptables, tcp_sockets
from tests.integration.netns_serve import (attack_under_load, complete, drops, listeners,
                                           netns_server, wait_for_drops)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPTS = ["Once upon a time, in a land far away, there lived a king who",
           "The three primary colours are", "def fibonacci(n):"]
P1D1_ARGS = ("--dtype", "float32", "--threads", "1", "--num-kv-blocks", "128",
             "--max-model-len", "256", "--prefill-workers", "1", "--decode-workers", "1",
             "--heartbeat-timeout", "3")
HEARTBEAT_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def cluster():
    require_netns()
    require_iptables()
    with NetnsTopology(("cluster", "attack"), root_port=True) as topo:
        server = netns_server(topo, "cluster", *P1D1_ARGS)
        try:
            server.wait_ready(400)
            yield topo, server
        finally:
            code = server.stop()
        assert code == 0, f"server did not stop cleanly ({code}):\n{server.output()}"


def test_attacker_in_another_namespace_changes_no_answer(cluster, tmp_path):
    topo, server = cluster
    marker = tmp_path / "pwned"
    want = {p: complete(server.url, p) for p in PROMPTS}  # unattacked reference
    endpoints = listeners(topo, "cluster")
    assert len(endpoints) >= 4, endpoints  # report ROUTER, 2 worker input ROUTERs, KV ROUTER
    drops_before = drops(server.url)
    got = attack_under_load(topo, "attack", endpoints, marker,
                            lambda: {p: complete(server.url, p) for p in PROMPTS})
    assert got == want, server.output()
    assert wait_for_drops(server.url, drops_before) > drops_before
    assert not marker.exists()
    assert {p: complete(server.url, p) for p in PROMPTS} == want  # still serving, same tokens
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def decode_worker_pid(topo: NetnsTopology, front_pid: int) -> int:
    """The front's one worker process that listens on no TCP port (the prefill worker serves
    KV pulls; the decode worker only dials out)."""
    workers = {c.pid for c in psutil.Process(front_pid).children()
               if "spawn_main" in " ".join(c.cmdline())}
    listening = {pid for state, _, pids in tcp_sockets(topo, "cluster") if state == "LISTEN"
                 for pid in pids}
    dialers = sorted(workers - listening)
    assert len(workers) == 2 and len(dialers) == 1, (workers, listening)
    return dialers[0]


def _health(url: str) -> int:
    return httpx.get(f"{url}/health", timeout=5).status_code


def _stream(url: str, prompt: str, started: threading.Event, out: dict) -> None:
    """A long greedy stream: `started` once tokens flow (it is on the decode worker), then
    every body line until the server ends it."""
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    lines = []
    t0 = time.monotonic()
    try:
        with httpx.stream("POST", f"{url}/v1/completions", timeout=120, json={
                "model": model, "prompt": prompt, "max_tokens": 200, "temperature": 0,
                "ignore_eos": True, "stream": True}) as r:
            for line in r.iter_lines():
                lines.append(line)
                if sum(1 for x in lines if x.startswith("data: {")) >= 2:
                    started.set()
    except httpx.HTTPError as exc:
        lines.append(f"transport error: {exc!r}")
    out["lines"], out["elapsed_s"] = lines, time.monotonic() - t0
    started.set()


def test_cutting_the_decode_worker_off_suspends_it_and_healing_restores_service(cluster):
    topo, server = cluster
    want = {p: complete(server.url, p) for p in PROMPTS}  # reference before the cut
    pid = decode_worker_pid(topo, server.proc.pid)
    assert local_ports(topo, "cluster", pid), "the decode worker holds no TCP connection"
    started, stream = threading.Event(), {}
    thread = threading.Thread(target=_stream, args=(server.url, PROMPTS[0], started, stream),
                              daemon=True)
    thread.start()
    assert started.wait(120) and "lines" not in stream, stream  # streaming from decode-0
    cut = PortCut(topo, "cluster")
    try:
        cut_at = time.monotonic()
        cut.cut(pid)
        while _health(server.url) == 200:
            cut.refresh()  # a re-dialled connection is cut as well
            assert time.monotonic() - cut_at < HEARTBEAT_TIMEOUT_S + 10, "still healthy"
            time.sleep(0.2)
        detected_s = time.monotonic() - cut_at
        assert detected_s >= HEARTBEAT_TIMEOUT_S - 0.5, detected_s  # not before the timeout
        # The stream in flight ends with a clear error naming the worker, not a hang.
        thread.join(30)
        assert not thread.is_alive(), "the stream in flight hangs after the cut"
        body = "\n".join(stream["lines"])
        assert '"error"' in body and "decode-0" in body, body[-2000:]
        assert "transport error" not in body, body[-2000:]  # the server ended it
        # New requests are refused at once while no decode worker can serve.
        t0 = time.monotonic()
        with pytest.raises(httpx.HTTPStatusError) as refused:
            complete(server.url, PROMPTS[1], timeout_s=30)
        assert refused.value.response.status_code == 503, refused.value.response.text
        assert time.monotonic() - t0 < 10
        cut.refresh()
        assert _health(server.url) == 503
    finally:
        cut.heal()
    # Healed: heartbeats reach the front again, decode-0 is back (the same process), and it
    # answers exactly as before.
    deadline = time.monotonic() + 50  # under hung_restart_after_s: resumed, not restarted
    while _health(server.url) != 200:
        assert time.monotonic() < deadline, f"not healthy after heal:\n{server.output()}"
        time.sleep(0.3)
    assert decode_worker_pid(topo, server.proc.pid) == pid
    assert {p: complete(server.url, p) for p in PROMPTS} == want
    assert "decode-0 suspended from routing: missed heartbeats" in server.output()
    assert "decode-0 is back in routing" in server.output()
