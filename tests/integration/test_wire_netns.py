"""Hostile frames across real network namespaces: a P1/D1 cluster (front and both workers) runs
in namespace "cluster" with every socket on its 10.x address (`--host`, `--cluster-host`); an
attacker process in namespace "attack" reaches it only over veth + bridge and throws garbage,
truncated, oversized, foreign-key, forged, replayed, wrongly typed, multi-part and pickled
frames at every listening TCP port while greedy requests run. The test process talks HTTP
through its own bridge port. Outputs must equal the same prompts' outputs before the attack,
no file may appear, drops are counted, and the server still answers."""
from __future__ import annotations

import httpx
import pytest

from tests.integration.netns import NetnsTopology, require_netns
from tests.integration.netns_serve import (attack_under_load, complete, drops, listeners,
                                           netns_server, wait_for_drops)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPTS = ["Once upon a time, in a land far away, there lived a king who",
           "The three primary colours are", "def fibonacci(n):"]
P1D1_ARGS = ("--dtype", "float32", "--threads", "1", "--num-kv-blocks", "128",
             "--max-model-len", "256", "--prefill-workers", "1", "--decode-workers", "1")


@pytest.fixture(scope="module")
def cluster():
    require_netns()
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
    assert len(endpoints) >= 3, endpoints  # report PULL, 2 worker PUSHes, KV ROUTER
    drops_before = drops(server.url)
    got = attack_under_load(topo, "attack", endpoints, marker,
                            lambda: {p: complete(server.url, p) for p in PROMPTS})
    assert got == want, server.output()
    assert wait_for_drops(server.url, drops_before) > drops_before
    assert not marker.exists()
    assert {p: complete(server.url, p) for p in PROMPTS} == want  # still serving, same tokens
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
