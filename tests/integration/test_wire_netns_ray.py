"""The front and its workers in separate network namespaces, placed by Ray: a Ray head (no
CPUs) runs in namespace "front" and a Ray node offering `prefill_node` / `decode_node` in
namespace "worker" (`netns_ray.py`: real `ray start`, each node on its 10.x address); `deepinfer
serve --cluster ray` runs in "front" (RAY_ADDRESS = the head), binds HTTP and its worker
sockets on the front's address, and its P1/D1 actors land on the worker node by their role
resources. The attacker runs in namespace "attack"; the test process talks HTTP through its own
bridge port.

- Placement is real: both actors' processes are in the worker namespace (and not the front's),
  Ray reports the worker's address as their node IP, the prefill worker's KV server listens
  there, and each worker holds TCP connections to the front's DeepInfer ports on the front's
  address (so through its veth and the bridge). Greedy tokens equal the offline engine.
- Under attack on every DeepInfer port of both namespaces (the front's channels and the
  prefill worker's KV server) while requests run: the same tokens, no file, drops counted.
  Ray's own ports are left alone: Ray's protocol is not authenticated (Ray's documented model:
  its ports must only be reachable from the cluster), so garbage on them tests Ray, not
  DeepInfer. They are pinned (netns_ray.RAY_PORTS, WORKER_PORTS) and listed by the test: in
  "front" the GCS (6379), the head raylet's node-manager and object-manager ports, the
  dashboard agent's, the runtime-env agent's, the metrics export port, the Ray Client server,
  the driver's (the front's own) core-worker gRPC port, and two ports Ray has no flag for (the
  autoscaler monitor's and the dashboard head's, on 0.0.0.0); in "worker" the node's raylet and
  agents and each actor's core-worker gRPC port. Attacked: the front's report ROUTER and per-
  worker input ROUTERs, and the prefill worker's KV server (the decode worker only dials).
- Cut and heal: the worker namespace's bridge port goes down (both workers unreachable, Ray's
  node too): /health is 503 after the heartbeat timeout; brought back within Ray's node
  timeout, the same actors are back in routing and answer as before."""
from __future__ import annotations

import time

import httpx
import psutil
import pytest

pytest.importorskip("ray")  # the `ray` CLI of this environment starts the nodes

from deepinfer.sampling_params import SamplingParams  # noqa: E402
from tests.integration.netns import NetnsTopology, require_netns  # noqa: E402
from tests.integration.netns_ray import (GCS_PORT, RAY_ENV, RAY_PORTS, NetnsRay,  # noqa: E402
                                         is_ray_port, pids_in, ray_listeners, sockets, tx_bytes)
from tests.integration.netns_serve import (DROPPED, HTTP_PORT, attack_under_load,  # noqa: E402
                                           drops, netns_server, wait_for_drops)
from tests.integration.serve_process import (ADMIN_FLAGS, ADMIN_HEADERS,  # noqa: E402
                                            scrape_metrics)

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.timeout(1200)]

PROMPTS = ["Once upon a time, in a land far away, there lived a king who",
           "The three primary colours are", "def fibonacci(n):"]
MAX_TOKENS = 16
HEARTBEAT_TIMEOUT_S = 3.0
ARGS = ("--dtype", "float32", "--threads", "1", "--num-kv-blocks", "128",
        "--max-model-len", "256", "--kv-store", "none", "--seed", "0",
        "--prefill-workers", "1", "--decode-workers", "1", "--cluster", "ray",
        "--prefill-resources", '{"num_cpus": 1, "prefill_node": 1}',
        "--decode-resources", '{"num_cpus": 1, "decode_node": 1}',
        "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S), *ADMIN_FLAGS)
WORKER_NODE = (2, {"prefill_node": 1, "decode_node": 1})


@pytest.fixture(scope="module")
def cluster():
    require_netns()
    with NetnsTopology(("front", "worker", "attack"), root_port=True) as topo, \
            NetnsRay(topo, "front", {"worker": WORKER_NODE}) as ray_cluster:
        server = netns_server(topo, "front", *ARGS,
                              env={"RAY_ADDRESS": ray_cluster.address, **RAY_ENV})
        try:
            server.wait_ready(600)
            yield topo, server
        finally:
            code = server.stop()
        assert code == 0, f"server did not stop cleanly ({code}):\n{server.output()}"


@pytest.fixture(scope="module")
def want(engine_base_llm, default_model_source):
    """{prompt: (its token ids, the offline engine's greedy tokens)}."""
    tokenizer = default_model_source.load_tokenizer()
    ids = {p: tokenizer.encode(p) for p in PROMPTS}
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = engine_base_llm.generate([{"prompt_token_ids": i} for i in ids.values()], params,
                                    use_tqdm=False)
    return {p: (ids[p], list(o.outputs[0].token_ids)) for p, o in zip(PROMPTS, outs)}


def ask(url: str, want: dict) -> dict:
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    got = {}
    for prompt, (ids, _) in want.items():
        r = httpx.post(f"{url}/v1/completions", timeout=180, json={
            "model": model, "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True})
        r.raise_for_status()
        got[prompt] = r.json()["choices"][0]["token_ids"]
    return got


def expected(want: dict) -> dict:
    return {p: tokens for p, (_, tokens) in want.items()}


def placements(url: str) -> dict[str, dict]:
    workers = httpx.get(f"{url}/admin/workers", headers=ADMIN_HEADERS, timeout=30).json()
    return {w["worker_id"]: w["placement"] for w in workers["workers"]}


def front_pids(server) -> set[int]:
    proc = psutil.Process(server.proc.pid)
    return {proc.pid} | {c.pid for c in proc.children(recursive=True)}


def deepinfer_endpoints(topo: NetnsTopology, server) -> tuple[list[str], dict, dict]:
    """tcp:// endpoints of every DeepInfer listener of the front's and the worker's namespace,
    and each namespace's Ray ports ({port: owner})."""
    actor_pids = {p["pid"] for p in placements(server.url).values()}
    front, front_ray = ray_listeners(topo, "front", front_pids(server), HTTP_PORT)
    worker, worker_ray = ray_listeners(topo, "worker", actor_pids, HTTP_PORT)
    endpoints = [f"tcp://{topo.address('front')}:{p}" for p in front] + \
        [f"tcp://{topo.address('worker')}:{p}" for p in worker]
    return endpoints, front_ray, worker_ray


def test_workers_run_in_the_worker_namespace_across_the_veth(cluster, want):
    topo, server = cluster
    front_addr, worker_addr = topo.address("front"), topo.address("worker")
    placed = placements(server.url)
    assert set(placed) == {"prefill-0", "decode-0"}, placed
    assert all(p["launcher"] == "ray" and p["node_ip"] == worker_addr for p in placed.values())
    pids = {wid: p["pid"] for wid, p in placed.items()}
    in_worker, in_front = set(pids_in(topo, "worker")), set(pids_in(topo, "front"))
    assert set(pids.values()) <= in_worker and not set(pids.values()) & in_front, pids
    # The prefill worker's KV server listens on the worker's address, in its namespace.
    front_ports, _ = ray_listeners(topo, "front", front_pids(server), HTTP_PORT)
    worker_ports, _ = ray_listeners(topo, "worker", {pids["prefill-0"]}, HTTP_PORT)
    assert front_ports and len(worker_ports) == 1, (front_ports, worker_ports)
    assert ray_listeners(topo, "worker", {pids["decode-0"]}, HTTP_PORT)[0] == []  # dials only
    # Each worker's channels to the front are TCP connections to the front's address.
    established = sockets(topo, "worker", listening=False)
    for wid, pid in pids.items():
        peers = {peer for host, _, peer, owners in established
                 if pid in owners and host == worker_addr}
        to_front = {peer for peer in peers if peer.rpartition(":")[0] == front_addr
                    and int(peer.rpartition(":")[2]) in front_ports}
        assert to_front, (wid, peers, front_ports)
    sent = tx_bytes(topo, "worker")
    assert ask(server.url, want) == expected(want)
    assert tx_bytes(topo, "worker") > sent


def test_attacker_in_a_third_namespace_changes_no_answer(cluster, want, tmp_path):
    topo, server = cluster
    marker = tmp_path / "pwned"
    assert ask(server.url, want) == expected(want)
    endpoints, front_ray, worker_ray = deepinfer_endpoints(topo, server)
    # The front: its report ROUTER and an input ROUTER per worker; the worker: its KV server.
    assert sum(e.startswith(f"tcp://{topo.address('front')}:") for e in endpoints) >= 3
    assert sum(e.startswith(f"tcp://{topo.address('worker')}:") for e in endpoints) == 1
    assert GCS_PORT in front_ray and RAY_PORTS["--node-manager-port"] in worker_ray
    for ray_ports in (front_ray, worker_ray):  # left alone: Ray's own, all of them
        assert all(is_ray_port(p) or "/ray/" in owner for p, owner in ray_ports.items()), \
            ray_ports
    before, kv_before = drops(server.url), kv_pull_drops(server.url)
    got = attack_under_load(topo, "attack", endpoints, marker, lambda: ask(server.url, want))
    assert got == expected(want), server.output()
    assert wait_for_drops(server.url, before) > before
    # Counted by the prefill worker in the other namespace, reported to the front in its stats.
    deadline = time.monotonic() + 30
    while kv_pull_drops(server.url) <= kv_before:
        assert time.monotonic() < deadline, scrape_metrics(server.url)
        time.sleep(0.3)
    assert not marker.exists()
    assert ask(server.url, want) == expected(want)
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def kv_pull_drops(url: str) -> float:
    return sum(v for k, v in scrape_metrics(url).items()
               if k.startswith(DROPPED + "{") and 'channel="kv.pull"' in k)


def _health(url: str) -> int:
    return httpx.get(f"{url}/health", timeout=5).status_code


def test_cutting_the_worker_namespace_off_and_healing_it(cluster, want):
    topo, server = cluster
    before = {wid: p["pid"] for wid, p in placements(server.url).items()}
    assert ask(server.url, want) == expected(want)
    cut_at = time.monotonic()
    topo.cut("worker")
    try:
        while _health(server.url) == 200:
            assert time.monotonic() - cut_at < HEARTBEAT_TIMEOUT_S + 15, "still healthy"
            time.sleep(0.2)
        assert time.monotonic() - cut_at >= HEARTBEAT_TIMEOUT_S - 0.5
        time.sleep(1.0)
        assert _health(server.url) == 503
    finally:
        topo.heal("worker")
    deadline = time.monotonic() + 50  # well inside Ray's node timeout (netns_ray.RAY_ENV)
    while _health(server.url) != 200:
        assert time.monotonic() < deadline, f"not healthy after heal:\n{server.output()}"
        time.sleep(0.3)
    assert {wid: p["pid"] for wid, p in placements(server.url).items()} == before  # resumed
    assert ask(server.url, want) == expected(want)
