"""benchmarks/store_routing_bench.py's simulator (the prefill worker's store path over the
cluster simulator): least-compute over the shared store reaches cache affinity's prefix hit
rate on skewed system prompts while spreading the work. Small runs, seconds."""
from __future__ import annotations

import runpy
from pathlib import Path
from types import SimpleNamespace

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "store_routing_bench.py"


@pytest.fixture(scope="module")
def bench():
    return SimpleNamespace(**runpy.run_path(str(SCRIPT)))  # its names, without running main


def run(bench, label: str, requests, num_workers: int):
    router, options, new = bench.SIM_POLICIES[label]
    cluster = bench.sim_cluster(num_workers, num_workers, router, 2.0, 0.5)
    sim = bench.StoreRoutingSimulator(cluster, new_store_path=new)
    sim.prefill_router = bench.build_prefill_router(router, **options)
    records = sim.run(requests)
    assert all(r.error is None for r in records)
    return records, sim


@pytest.mark.parametrize("num_workers,num_requests", [(4, 40), (8, 20)])
def test_least_compute_over_the_store_hits_as_often_as_cache_affinity(bench, num_workers,
                                                                      num_requests):
    # Before: a request queued behind one that awaited the prefix elsewhere, or one that
    # reached a worker just before the prefix's store write landed, computed it again.
    requests = bench.skewed_workload(num_requests, 40.0, seed=0)
    affinity, _ = run(bench, "cache-affinity", requests, num_workers)
    spread, sim = run(bench, "least-compute+store", requests, num_workers)
    lost = [(s.request_id, a.num_cached_tokens, s.num_cached_tokens)
            for a, s in zip(affinity, spread) if s.num_cached_tokens < a.num_cached_tokens]
    assert lost == []  # per request, not only in total
    assert sum(r.num_store_tokens for r in spread) > 0  # cross-worker reuse from the store
    busy = {r.prefill_worker for r in spread}
    assert len(busy) > len({r.prefill_worker for r in affinity})  # and the work spread
    assert sim.prefill_router.locator._requests == {}  # every prefill reported done
