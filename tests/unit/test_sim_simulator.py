"""Simulator: it runs the engine's own classes, is deterministic, conserves requests and
blocks, and responds sensibly to more workers. Small workloads: seconds in all."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from deepinfer.bench.workloads import WorkloadConfig, build_workload
from deepinfer.core.compute_budget import ComputeAwarePolicy
from deepinfer.core.kv_cache_manager import KVCacheManager
from deepinfer.core.scheduler import Scheduler
from deepinfer.core.step_budget import TokenBudgetPolicy
from deepinfer.routing import DECODE_POLICIES, PREFILL_POLICIES, RoutingRequest
from deepinfer.sim import ClusterSimulator, cluster_from_dict, simulate_workload, to_bench_json

PROFILE = str(Path(__file__).resolve().parents[2] / "benchmarks" / "results"
              / "cost_profile_smollm2_bf16_cpu_1thread.json")


def cluster(pools: dict, **extra):
    data = {"cost": {"profile": PROFILE}, "engine": {"num_kv_blocks": 1024}, "pools": pools}
    data.update(extra)
    return cluster_from_dict(data)


PD = {"prefill": {"workers": 2}, "decode": {"workers": 2}}


def test_simulator_runs_the_engines_own_classes():
    sim = ClusterSimulator(cluster(PD, routers={"prefill": "round-robin", "decode": "least-kv"}))
    for worker in sim.workers.values():
        assert type(worker.scheduler) is Scheduler
        assert type(worker.scheduler.kv) is KVCacheManager
        assert type(worker.scheduler.budget_policy) is TokenBudgetPolicy
    assert type(sim.prefill_router) is PREFILL_POLICIES["round-robin"]
    assert type(sim.decode_router) is DECODE_POLICIES["least-kv"]
    assert Scheduler.__module__ == "deepinfer.core.scheduler"
    compute = ClusterSimulator(cluster({"colocated": {"workers": 1}},
                                       engine={"scheduler": "compute-aware"}))
    assert type(compute.workers["colocated-0"].scheduler.budget_policy) is ComputeAwarePolicy


def _json(run, cfg) -> str:
    payload = to_bench_json(run, cfg)
    payload.pop("date")
    payload["simulation"].pop("wall_s")
    return json.dumps(payload, sort_keys=True)


def test_same_seed_same_result_other_seed_differs():
    spec = cluster(PD)
    cfg = WorkloadConfig(kind="random", num_prompts=12, input_len=100, output_len=8,
                         range_ratio=0.5, request_rate=20.0, seed=3)
    first = _json(simulate_workload(spec, build_workload(cfg)), cfg)
    assert first == _json(simulate_workload(spec, build_workload(cfg)), cfg)
    other = WorkloadConfig(**{**cfg.__dict__, "seed": 4})
    assert first != _json(simulate_workload(spec, build_workload(other)), other)


@pytest.mark.parametrize("pools", [PD, {"colocated": {"workers": 2}}])
def test_every_request_finishes_and_no_block_leaks(pools):
    # A small KV cache forces queueing (and, colocated, preemption).
    spec = cluster(pools, engine={"num_kv_blocks": 40, "max_num_seqs": 8})
    cfg = WorkloadConfig(kind="shared-prefix", num_prompts=24, input_len=48, output_len=64,
                         num_groups=3, shared_prefix_len=96, range_ratio=0.5, request_rate=50.0)
    run = simulate_workload(spec, build_workload(cfg), check_invariants=True)
    assert all(r.success for r in run.results), [r.error for r in run.results]
    assert [r.output_len for r in run.results] == [b.output_len for b in run.workload.requests]
    for worker in run.simulator.workers.values():
        worker.check_invariants()
        assert not worker.scheduler.has_unfinished_requests()
        assert not worker.transferring and not worker.waiting_alloc and not worker.inbox
        assert worker.scheduler.kv.pool.num_used_blocks == 0
    if "colocated" in pools:
        assert run.pool_stats()["colocated"]["num_preemptions"] > 0


def test_shared_store_serves_prefixes_computed_by_the_other_prefill_worker():
    cfg = WorkloadConfig(kind="shared-prefix", num_prompts=16, input_len=32, output_len=4,
                         num_groups=2, shared_prefix_len=256, request_rate=5.0)
    workload = build_workload(cfg)
    with_store = simulate_workload(cluster(PD, routers={"prefill": "round-robin"}), workload)
    without = simulate_workload(cluster(PD, routers={"prefill": "round-robin"},
                                        prefix_store="none"), workload)
    assert with_store.hit_rate_by_tier()["store"] > 0
    assert without.hit_rate_by_tier()["store"] == 0
    assert with_store.prefix_cache_hit_rate > without.prefix_cache_hit_rate


def test_more_workers_lower_latency_under_load():
    cfg = WorkloadConfig(kind="random", num_prompts=40, input_len=200, output_len=16,
                         request_rate=8.0)
    workload = build_workload(cfg)
    ttft = [simulate_workload(cluster({"colocated": {"workers": n}}), workload)
            .summary().ttft_ms.p50 for n in (1, 2, 4)]
    assert ttft[0] > ttft[1] > ttft[2]
    tpot = [simulate_workload(cluster(PD).with_workers(decode=d), workload)
            .summary().tpot_ms.p50 for d in (1, 3)]
    assert tpot[0] > tpot[1]


def test_host_contention_slows_workers_sharing_cores():
    workload = build_workload(WorkloadConfig(kind="random", num_prompts=16, input_len=64,
                                             output_len=16, request_rate=100.0))
    own = simulate_workload(cluster(PD), workload).summary()
    shared = simulate_workload(cluster(PD, host={"cores": 1}), workload).summary()
    assert shared.duration_s > own.duration_s


@pytest.mark.parametrize("bad, message", [
    ({"pools": {"colocated": {"workers": 1}}, "engin": {}}, "unknown keys"),
    ({"pools": {"prefill": {"workers": 1}}}, "both prefill and decode"),
    ({"pools": {"colocated": {"workers": 0}}}, "workers must be >= 1"),
    ({"pools": {"colocated": {}}, "routers": {"decode": "nope"}}, "unknown decode router"),
])
def test_bad_cluster_files_raise_value_error(bad, message):
    data = {"cost": {"profile": PROFILE}, **bad}
    with pytest.raises(ValueError, match=message):
        cluster_from_dict(data)


def test_cost_needs_profile_or_roofline():
    with pytest.raises(ValueError, match="either profile"):
        cluster_from_dict({"cost": {}, "pools": {"colocated": {}}})
    with pytest.raises(ValueError, match="both accelerator and model"):
        cluster_from_dict({"cost": {"accelerator": "H800"}, "pools": {"colocated": {}}})


def test_front_tells_the_prefill_router_when_prefills_are_done():
    # As the real front does: every routed prompt is reported done (handed off, or finished
    # by its first token), so a router that tracks in-flight prefixes holds none at the end.
    cfg = WorkloadConfig(kind="shared-prefix", num_prompts=12, input_len=32, output_len=2,
                         num_groups=2, shared_prefix_len=64, range_ratio=0.9, request_rate=20.0)
    run = simulate_workload(cluster(PD), build_workload(cfg))
    assert all(r.success for r in run.results)
    locator = run.simulator.prefill_router.locator  # least-compute tracks prefixes
    assert locator is not None
    assert locator._requests == {}


def test_a_request_the_router_plans_to_await_a_prefix_is_held_until_it_is_stored():
    """As the real prefill worker holds it: admitted once the awaited blocks are in the store
    (or the plan's deadline passed), not computed at once beside the worker computing them."""
    cfg = WorkloadConfig(kind="shared-prefix", num_prompts=12, input_len=32, output_len=4,
                         num_groups=2, shared_prefix_len=512, request_rate=20.0)
    sim = ClusterSimulator(cluster({"prefill": {"workers": 2}, "decode": {"workers": 1}}))
    plans, delivered, stored_at = {}, {}, {}
    take, on_input, put = (sim.prefill_router.take_prefix_plan, sim._on_input,
                           sim.store.put_many)

    def take_plan(request_id):
        plan = take(request_id)
        if plan is not None and plan.num_await_blocks:
            plans[request_id] = plan
        return plan

    def record_input(worker, message):
        delivered.setdefault(getattr(message, "request_id", None), sim.now)
        on_input(worker, message)

    def record_put(hashes):
        for h in hashes:
            stored_at.setdefault(h, sim.now)
        return put(hashes)

    sim.prefill_router.take_prefix_plan = take_plan
    sim._on_input = record_input
    sim.store.put_many = record_put
    records = sim.run(build_workload(cfg).requests)
    assert all(r.done and r.error is None for r in records)
    awaited = [r for r in records if r.request_id in plans]
    assert awaited
    waited = 0
    for r in awaited:
        plan = plans[r.request_id]
        landed = max(stored_at.get(h, float("inf")) for h in r.block_hashes[:plan.num_await_blocks])
        released = min(landed, plan.await_until if plan.await_until is not None else landed)
        assert delivered[r.request_id] >= released - 1e-9
        waited += delivered[r.request_id] > r.arrival_s + 0.01
        if landed <= delivered[r.request_id]:  # the prefix was there: loaded, not recomputed
            assert r.num_cached_tokens >= (plan.num_await_blocks - 1) * 16, (r.num_store_tokens, r.num_cached_tokens)
    assert waited >= 1
    assert sim.num_awaited >= waited


def test_prefill_workers_report_their_measured_compute_rate_to_the_router():
    """As `cluster.prefill_worker` does: each step's (simulated, host-shared) wall seconds per
    computed token feed an EWMA the load report carries, and the least-compute router scales
    that worker's costs by it. Decode workers report none."""
    workload = build_workload(WorkloadConfig(kind="random", num_prompts=6, input_len=128,
                                             output_len=4, request_rate=float("inf")))
    alone = simulate_workload(cluster(PD), workload).simulator
    sim = simulate_workload(cluster(PD, host={"cores": 1}), workload).simulator
    for worker, own in zip(sim.pools["prefill"], alone.pools["prefill"]):
        rate = worker.last_load.compute_s_per_token
        assert rate is not None and rate != worker.compute_rate.prior_s_per_unit
        # sharing one core stretches the steps' wall time, and so the rate it reports
        assert rate > own.last_load.compute_s_per_token
    assert all(w.last_load.compute_s_per_token is None for w in sim.pools["decode"])
    # the rate is what routing sees: a worker reporting a 10x rate gets no request
    slow, fast = sim.pools["prefill"]
    router = sim.prefill_router
    loads = [dataclasses.replace(slow.last_load, compute_s_per_token=10 * rate),
             dataclasses.replace(fast.last_load, compute_s_per_token=rate)]
    chosen = {router.route(RoutingRequest(request_id=f"x{i}", num_prompt_tokens=128), loads,
                           sim.now) for i in range(3)}
    assert chosen == {fast.worker_id}
