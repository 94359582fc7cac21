"""Least-compute routing calibrated by the workers' measured prefill rate
(`WorkerLoad.compute_s_per_token`): on a machine slower than the cost model assumes, queues
are as long as they really are next to measured store loads, so a worker holding a prefix on
device stops winning requests that another worker can load from the store and serve sooner."""
from __future__ import annotations

import pytest

from deepinfer.core.prefix_hash import hash_request_blocks
from deepinfer.routing import (LinearQuadraticPrefillCost, RoutingRequest, WorkerLoad,
                               build_prefill_router)

BS = 16
SYSTEM = list(range(100, 100 + 512))
MODEL_S_PER_TOKEN = LinearQuadraticPrefillCost()(256, 0) / 256
STORE_S_PER_TOKEN = 2e-4  # measured fs reads on a loaded machine


def request(rid: str, seed: int) -> RoutingRequest:
    prompt = SYSTEM + [5000 + seed * 97 + i for i in range(48)]
    return RoutingRequest(rid, len(prompt), hash_request_blocks(prompt, BS))


def loads(t: float, compute_s_per_token: float | None) -> list[WorkerLoad]:
    """p0 holds three suffix-only prompts in its queue; p1 is idle."""
    return [WorkerLoad("p0", "prefill", t, num_waiting_reqs=3, num_queued_uncached_tokens=3 * 48,
                       store_load_s_per_token=STORE_S_PER_TOKEN,
                       compute_s_per_token=compute_s_per_token),
            WorkerLoad("p1", "prefill", t, store_load_s_per_token=STORE_S_PER_TOKEN,
                       compute_s_per_token=compute_s_per_token)]


def route_after_warmup(compute_s_per_token: float | None) -> tuple[str, float]:
    router = build_prefill_router("least-compute")
    idle = [WorkerLoad("p0", "prefill", 0.0), WorkerLoad("p1", "prefill", 1.0)]
    assert router.route(request("a", 1), idle, 0.0) == "p0"
    router.on_prefill_done("a")  # the prefix: on p0's device and in the store
    worker = router.route(request("b", 2), loads(1.0, compute_s_per_token), 1.0)
    return worker, router.reserved(worker).predicted_cost_s


def test_measured_compute_rate_scales_queues_and_compute_not_store_loads():
    # The cost model's own speed: p0's queue looks short next to p1's 0.1 s store load.
    assert route_after_warmup(None)[0] == "p0"
    assert route_after_warmup(MODEL_S_PER_TOKEN)[0] == "p0"  # measured == modelled: same
    # Measured 30x slower than modelled: p0's queue is ~1.3 s, p1 loads and starts now.
    worker, cost = route_after_warmup(30 * MODEL_S_PER_TOKEN)
    assert worker == "p1"
    suffix = 30 * LinearQuadraticPrefillCost()(48, 512)
    assert cost == pytest.approx(512 * STORE_S_PER_TOKEN + suffix)  # load, then the suffix


def test_compute_rate_must_not_be_negative():
    with pytest.raises(ValueError, match="compute_s_per_token"):
        WorkerLoad("p0", "prefill", 0.0, compute_s_per_token=-1.0)


def test_a_worker_that_has_not_reported_its_rate_takes_its_peers_not_the_models():
    """Workers report their rate after their first step. One that has not yet must not look
    as fast as the cost model while its peer measured itself 5x slower: it took every prompt
    (17 in a row in a simulated Mooncake replay) until it reported."""
    router = build_prefill_router("least-compute", track_prefixes=False)
    routed = {"p0": 0, "p1": 0}
    for i in range(10):
        loads = [WorkerLoad("p0", "prefill", float(i), compute_s_per_token=5 * MODEL_S_PER_TOKEN),
                 WorkerLoad("p1", "prefill", float(i))]  # p1: not reported yet
        worker = router.route(RoutingRequest(f"r{i}", 256, []), loads, float(i))
        routed[worker] += 1
    assert routed["p0"] >= 4 and routed["p1"] >= 4, routed
