"""Prefill routing: least-compute spreads queued compute; cache-affinity is stable."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import pytest

from deepinfer.core.prefix_hash import hash_request_blocks
from deepinfer.routing import (LinearQuadraticPrefillCost, NoWorkerAvailable, RoutingRequest,
                               WorkerLoad, build_prefill_router)
from deepinfer.routing.prefill_router import PREFILL_POLICIES

COST = LinearQuadraticPrefillCost()


def load(wid: str, t: float = 0.0, waiting: int = 0, tokens: int = 0,
         queue_s: float | None = None, role: str = "prefill") -> WorkerLoad:
    return WorkerLoad(wid, role, t, num_waiting_reqs=waiting, num_queued_uncached_tokens=tokens,
                      predicted_queue_time_s=queue_s)


@dataclass
class SimPrefillWorker:
    """FCFS queue of prefill jobs, each [remaining seconds, uncached tokens]; drains in real time."""

    worker_id: str
    report_queue_time: bool
    queue: deque = field(default_factory=deque)

    def submit(self, cost_s: float, num_tokens: int) -> None:
        self.queue.append([cost_s, num_tokens])

    def advance(self, dt: float) -> None:
        while dt > 0 and self.queue:
            used = min(dt, self.queue[0][0])
            self.queue[0][0] -= used
            dt -= used
            if self.queue[0][0] <= 1e-12:
                self.queue.popleft()

    def queue_time_s(self) -> float:
        return sum(job[0] for job in self.queue)

    def report(self, now: float) -> WorkerLoad:
        return load(self.worker_id, now, len(self.queue), sum(job[1] for job in self.queue),
                    self.queue_time_s() if self.report_queue_time else None)


def simulate(router, seed: int, num_workers: int = 4, num_steps: int = 400, dt: float = 0.05,
             rate: float = 16.0, report_every: int = 4, report_queue_time: bool = True):
    """Requests with heavy-tailed prompt lengths (some with shared-store hits) arrive as a
    Poisson process. Returns (time-averaged max/mean of queued seconds across workers, mean
    and p99 of the queued seconds each request found on its worker, i.e. its wait)."""
    rng = np.random.default_rng(seed)
    workers = [SimPrefillWorker(f"prefill-{i}", report_queue_time) for i in range(num_workers)]
    by_id = {w.worker_id: w for w in workers}
    loads = [w.report(0.0) for w in workers]
    ratios, waits = [], []
    for step in range(1, num_steps + 1):
        now = step * dt
        for w in workers:
            w.advance(dt)
        for k in range(rng.poisson(rate * dt)):
            prompt = int(rng.integers(1000, 4000)) if rng.random() < 0.2 else int(rng.integers(20, 400))
            cached = int(prompt * rng.choice([0.0, 0.5, 0.9]))
            req = RoutingRequest(f"r{step}.{k}", prompt, num_cached_tokens_hint=cached)
            worker = by_id[router.route(req, loads, now)]
            waits.append(worker.queue_time_s())
            worker.submit(COST(prompt - cached, cached), prompt - cached)
        if step % report_every == 0:
            loads = [w.report(now) for w in workers]
            for ld in loads:
                router.on_load_report(ld)
        queued = np.array([w.queue_time_s() for w in workers])
        if step > 40 and queued.mean() > 0:
            ratios.append(queued.max() / queued.mean())
    return float(np.mean(ratios)), float(np.mean(waits)), float(np.percentile(waits, 99))


@pytest.mark.parametrize("seed,report_queue_time", [(0, True), (1, False), (2, True)])
def test_least_compute_spreads_queued_compute(seed, report_queue_time):
    # ~75% utilization: the queued compute a request finds on its worker is its wait (TTFT).
    ours = simulate(build_prefill_router("least-compute", prefill_cost=COST), seed, rate=40.0,
                    report_queue_time=report_queue_time)
    rr = simulate(build_prefill_router("round-robin"), seed, rate=40.0,
                  report_queue_time=report_queue_time)
    lr = simulate(build_prefill_router("least-requests"), seed, rate=40.0,
                  report_queue_time=report_queue_time)
    _, wait, wait_p99 = ours
    assert wait < 0.5 * rr[1] and wait < lr[1], (ours, rr, lr)
    assert wait_p99 < rr[2] and wait_p99 < lr[2], (ours, rr, lr)


@pytest.mark.parametrize("seed", [0, 1])
def test_least_compute_balances_backlog_under_saturation(seed):
    ratio = simulate(build_prefill_router("least-compute"), seed, rate=50.0)[0]
    assert ratio < simulate(build_prefill_router("round-robin"), seed, rate=50.0)[0]
    assert ratio < simulate(build_prefill_router("least-requests"), seed, rate=50.0)[0]


def test_least_compute_counts_cached_tokens_as_cheap():
    router = build_prefill_router("least-compute")
    loads = [load("p0"), load("p1")]
    # A fully cold long prompt reserves more compute than a mostly cached one of the same length.
    router.route(RoutingRequest("cold", 4000), loads, 1.0)
    router.route(RoutingRequest("warm", 4000, num_cached_tokens_hint=3900), loads, 1.0)
    assert router.reserved("p0").predicted_cost_s > 10 * router.reserved("p1").predicted_cost_s
    assert router.route(RoutingRequest("next", 100), loads, 1.0) == "p1"


def test_least_compute_burst_spreads_by_reservation():
    router = build_prefill_router("least-compute")
    loads = [load(f"p{i}") for i in range(4)]
    picks = [router.route(RoutingRequest(f"r{k}", 512), loads, 1.0) for k in range(12)]
    assert sorted(picks.count(f"p{i}") for i in range(4)) == [3, 3, 3, 3]
    # The next report (after the burst) replaces the reservations with the reported queue.
    for i in range(4):
        router.on_load_report(load(f"p{i}", 2.0, queue_s=0.1 * i))
    assert router.ledger.num_reservations() == 0
    assert router.route(RoutingRequest("after", 512), loads, 2.5) == "p0"


def test_least_compute_uses_queued_tokens_without_a_reported_queue_time():
    router = build_prefill_router("least-compute")
    loads = [load("p0", waiting=2, tokens=6000), load("p1", waiting=5, tokens=1000)]
    assert router.route(RoutingRequest("r", 100), loads, 1.0) == "p1"
    assert router.predicted_queue_time_s(loads[0]) == pytest.approx(2 * COST(3000, 0))


def _prefix_hashes(prefix: list[int], suffix: list[int]) -> tuple[bytes, ...]:
    return tuple(hash_request_blocks(prefix + suffix, 16))


def test_cache_affinity_is_stable_for_equal_prefixes():
    router = build_prefill_router("cache-affinity", num_affinity_blocks=2)
    loads = [load(f"p{i}") for i in range(4)]
    prefix = list(range(100, 132))  # two full blocks
    owners = {router.route(RoutingRequest(f"r{k}", 64, _prefix_hashes(prefix, [k] * 32)), loads, 1.0)
              for k in range(20)}
    assert len(owners) == 1
    # Different prefixes spread over the workers.
    spread = {router.route(RoutingRequest(f"s{k}", 32, _prefix_hashes([k] * 32, [])), loads, 1.0)
              for k in range(64)}
    assert spread == {f"p{i}" for i in range(4)}


def test_cache_affinity_moves_only_the_removed_workers_keys():
    loads = [load(f"p{i}") for i in range(5)]
    reqs = [RoutingRequest(f"r{k}", 16, _prefix_hashes([k] * 16, [])) for k in range(200)]
    before = {r.request_id: build_prefill_router("cache-affinity").select(r, loads, 0.0) for r in reqs}
    router = build_prefill_router("cache-affinity")
    router.remove_worker("p3")
    after = {r.request_id: router.select(r, loads, 0.0) for r in reqs}
    moved = [rid for rid in before if before[rid] != after[rid]]
    assert moved and all(before[rid] == "p3" for rid in moved)
    assert "p3" not in after.values()


def test_cache_affinity_escape_hatch_and_no_block_fallback():
    router = build_prefill_router("cache-affinity", max_imbalance_tokens=1000)
    req = RoutingRequest("r", 32, _prefix_hashes([7] * 32, []))
    owner = router.select(req, [load("p0"), load("p1")], 0.0)
    other = "p1" if owner == "p0" else "p0"
    busy = [load(owner, waiting=3, tokens=5000), load(other)]
    assert router.select(req, busy, 1.0) == other
    assert router.select(RoutingRequest("short", 5), busy, 1.0) == other  # no full block


@pytest.mark.parametrize("name", sorted(PREFILL_POLICIES))
def test_never_picks_unhealthy_removed_or_decode_workers(name):
    router = build_prefill_router(name)
    loads = [load("p0"), WorkerLoad("p1", "prefill", 0.0, healthy=False),
             WorkerLoad("d0", "decode", 0.0), load("c0", role="colocated")]
    router.remove_worker("p0")
    picks = {router.route(RoutingRequest(f"r{k}", 64, _prefix_hashes([k] * 16, [])), loads, 1.0)
             for k in range(10)}
    assert picks == {"c0"}
    with pytest.raises(NoWorkerAvailable, match="no healthy"):
        router.route(RoutingRequest("x", 10), loads[:3], 1.0)


def test_round_robin_cycles_in_worker_order():
    router = build_prefill_router("round-robin")
    loads = [load("p1"), load("p0"), load("p2")]
    assert [router.route(RoutingRequest(f"r{k}", 10), loads, 0.0) for k in range(5)] == \
        ["p0", "p1", "p2", "p0", "p1"]


def test_factory_and_request_validation():
    with pytest.raises(ValueError, match="unknown prefill routing policy"):
        build_prefill_router("random")
    with pytest.raises(ValueError, match="bad options"):
        build_prefill_router("round-robin", prefill_cost=COST)
    with pytest.raises(ValueError, match="num_cached_tokens_hint"):
        RoutingRequest("r", 10, num_cached_tokens_hint=11)
    with pytest.raises(ValueError, match="role"):
        WorkerLoad("w", "encoder", 0.0)



def test_cost_model_prefill_cost_feeds_least_compute():
    from types import SimpleNamespace

    from deepinfer.core.cost_model import CostModel
    from deepinfer.core.model_shape import ModelShape
    from deepinfer.routing import CostModelPrefillCost
    config = SimpleNamespace(num_hidden_layers=30, hidden_size=576, num_attention_heads=9,
                             num_key_value_heads=3, head_dim=64, intermediate_size=1536,
                             vocab_size=49152, tie_word_embeddings=True)
    model = CostModel(ModelShape.from_model_config(config, dtype_bytes=2),
                      {"linear_flops": 2e-11, "attention_flops": 6e-11, "step": 4e-3})
    cost = CostModelPrefillCost(model)
    assert cost(2000, 0) > cost(1000, 0) > cost(100, 900) > cost(0, 1000) > 0
    router = build_prefill_router("least-compute", prefill_cost=cost)
    loads = [load("p0"), load("p1")]
    router.route(RoutingRequest("long", 2000), loads, 0.0)
    assert router.reserved("p0").predicted_cost_s == pytest.approx(cost(2000, 0))
    assert [router.route(RoutingRequest(f"s{k}", 200), loads, 0.0) for k in range(3)] == ["p1"] * 3


def staged(wid: str, staged_bytes: int, cap: int | None = 1000, waiting: int = 0,
           tokens: int = 0) -> WorkerLoad:
    return WorkerLoad(wid, "prefill", 0.0, num_waiting_reqs=waiting,
                      num_queued_uncached_tokens=tokens, kv_staged_bytes=staged_bytes,
                      kv_staging_capacity_bytes=cap)


@pytest.mark.parametrize("name", sorted(PREFILL_POLICIES))
def test_back_pressure_skips_workers_whose_staging_is_full(name):
    router = build_prefill_router(name)
    # p0 is idle but cannot stage another prompt's KV; p1 is busy but has room.
    loads = [staged("p0", 1000), staged("p1", 10, waiting=5, tokens=5000)]
    picks = {router.route(RoutingRequest(f"r{k}", 64, _prefix_hashes([k] * 64, [])), loads, 1.0)
             for k in range(12)}
    assert picks == {"p1"} and router.num_staging_full == 0
    # Every worker full: still routed (each queues what it cannot stage yet), and counted.
    full = [staged("p0", 1000), staged("p1", 2000)]
    assert router.route(RoutingRequest("x", 64), full, 2.0) in {"p0", "p1"}
    assert router.num_staging_full == 1
    # No cap reported: never full.
    assert not staged("p0", 10**12, cap=None).staging_full


def test_staging_fields_are_validated():
    with pytest.raises(ValueError, match="kv_staged_bytes"):
        WorkerLoad("w", "prefill", 0.0, kv_staged_bytes=-1)
    with pytest.raises(ValueError, match="kv_staging_capacity_bytes"):
        WorkerLoad("w", "prefill", 0.0, kv_staging_capacity_bytes=0)
