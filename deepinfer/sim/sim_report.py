"""A simulated run in `deepinfer bench serve`'s JSON schema, plus what only a simulator sees.

`run_simulation` builds the workload with the bench's own `build_workload`, runs the cluster
and returns a `SimRun`; `to_bench_json` writes the same top-level keys as `bench serve`
(`summary`, `requests`, `prefix_cache_hit_rate`, ...) and a `simulation` section (hit rate by
tier, utilisation and peak KV use per pool, transfers, preemptions). `compare_runs` puts two
such JSON documents side by side (simulated vs measured). Pure.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from deepinfer.bench.latency_stats import (BenchSummary, RequestResult, finite_json,
                                           request_columns, summarize)
from deepinfer.bench.workloads import Workload, WorkloadConfig, build_workload
from deepinfer.sim.cluster_spec import ClusterSpec
from deepinfer.sim.sim_request import SimRequest
from deepinfer.sim.simulator import ClusterSimulator


@dataclass
class SimRun:
    cluster: ClusterSpec
    workload: Workload
    records: list[SimRequest]
    results: list[RequestResult]
    duration_s: float
    simulator: ClusterSimulator
    wall_s: float

    def summary(self, slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None
                ) -> BenchSummary:
        return summarize(self.results, self.duration_s, slo_ttft_ms, slo_tpot_ms)

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        done = [r for r in self.records if r.num_cached_tokens is not None]
        queried = sum(r.prompt_len for r in done)
        return sum(r.num_cached_tokens for r in done) / queried if queried else None

    def hit_rate_by_tier(self) -> dict[str, float | None]:
        done = [r for r in self.records if r.num_cached_tokens is not None]
        queried = sum(r.prompt_len for r in done)
        if not queried:
            return {"device": None, "store": None}
        store = sum(r.num_store_tokens for r in done)
        return {"device": (sum(r.num_cached_tokens for r in done) - store) / queried,
                "store": store / queried}

    def pool_stats(self) -> dict[str, dict[str, float]]:
        out = {}
        for role, workers in self.simulator.pools.items():
            busy = sum(w.busy_time_s for w in workers)
            out[role] = {
                "workers": len(workers),
                "utilization": busy / (self.duration_s * len(workers)) if self.duration_s else 0.0,
                "peak_kv_usage": max(w.peak_kv_usage for w in workers),
                "num_steps": sum(w.num_steps for w in workers),
                "num_preemptions": sum(w.scheduler.num_preemptions for w in workers),
            }
        return out


def run_simulation(cluster: ClusterSpec, workload_cfg: WorkloadConfig, *,
                   check_invariants: bool = False) -> SimRun:
    workload = build_workload(workload_cfg)
    return simulate_workload(cluster, workload, check_invariants=check_invariants)


def simulate_workload(cluster: ClusterSpec, workload: Workload, *,
                      check_invariants: bool = False) -> SimRun:
    start = time.perf_counter()
    sim = ClusterSimulator(cluster, check_invariants=check_invariants)
    records = sim.run(workload.requests)
    results = [r.to_result() for r in records]
    end = max((t for r in records for t in r.token_times_s), default=0.0)
    first = min((r.arrival_s for r in records), default=0.0)
    return SimRun(cluster, workload, records, results, end - first, sim,
                  time.perf_counter() - start)


def to_bench_json(run: SimRun, workload_cfg: WorkloadConfig, *, model: str = "simulated",
                  slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None,
                  cluster_source: str | None = None) -> dict[str, Any]:
    results = run.results
    summary = run.summary(slo_ttft_ms, slo_tpot_ms)
    sim = run.simulator
    payload = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "host": "simulator", "base_url": f"sim://{cluster_source or run.cluster.describe()}",
        "model": model, "endpoint": "completions", "workload": run.workload.description,
        "workload_config": {**dataclasses.asdict(workload_cfg),
                            "shrink": dataclasses.asdict(workload_cfg.shrink)},
        "summary": dataclasses.asdict(summary),
        "prefix_cache_hit_rate": run.prefix_cache_hit_rate,
        "slo": {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms},
        "requests": request_columns(results),
        "simulation": {
            "cluster": run.cluster.describe(),
            "num_accelerators": run.cluster.num_accelerators(),
            "hit_rate_by_tier": run.hit_rate_by_tier(),
            "pools": run.pool_stats(),
            "num_kv_transfers": sim.num_transfers,
            "kv_transfer_bytes": sim.transfer_bytes,
            "store_blocks": len(sim.store) if sim.store is not None else None,
            "wall_s": run.wall_s,
        },
    }
    return finite_json(payload)


COMPARED = (("output_throughput", None), ("total_token_throughput", None),
            ("request_throughput", None), ("ttft_ms", "p50"), ("ttft_ms", "p90"),
            ("tpot_ms", "p50"), ("tpot_ms", "p90"), ("itl_ms", "p50"), ("e2e_ms", "p50"),
            ("duration_s", None))


def compare_runs(simulated: dict, measured: dict) -> list[tuple[str, float | None, float | None,
                                                               float | None]]:
    """(metric, simulated, measured, relative error sim/measured - 1) for two bench JSONs."""
    rows = []
    for key, sub in COMPARED:
        a, b = simulated["summary"].get(key), measured["summary"].get(key)
        if sub is not None:
            a = a.get(sub) if isinstance(a, dict) else None
            b = b.get(sub) if isinstance(b, dict) else None
        name = f"{key.removesuffix('_ms')}_{sub}_ms" if sub else key
        err = (a / b - 1.0) if (a is not None and b not in (None, 0)) else None
        rows.append((name, a, b, err))
    return rows


def format_comparison(rows) -> str:
    lines = [f"{'metric':<26}{'simulated':>14}{'measured':>14}{'error':>10}"]
    for name, a, b, err in rows:
        fa = "n/a" if a is None else f"{a:.2f}"
        fb = "n/a" if b is None else f"{b:.2f}"
        fe = "n/a" if err is None else f"{100 * err:+.1f}%"
        lines.append(f"{name:<26}{fa:>14}{fb:>14}{fe:>10}")
    return "\n".join(lines)


def first_decode_gap(records: list[SimRequest]) -> dict[str, float | int | None]:
    """P/D: the mean parts of each request's first decode gap (its prefill token to its first
    decode token, which `bench serve` counts as an inter-token interval), in the terms the
    decode workers' counters use: handoff -> transfer start (the decode worker draining its
    inputs at a step boundary and allocating), the transfer (link + both ends' CPU), and
    admission -> first token (the step in progress, then the step it joins); and the mean of
    the other token gaps."""
    parts = {"queue_alloc_s": [], "transfer_s": [], "admit_to_token_s": [], "gap_s": []}
    later: list[float] = []
    for r in records:
        times = r.token_times_s
        if r.admitted_s is None or r.transfer_start_s is None or r.handoff_s is None \
                or len(times) < 2:
            continue
        parts["queue_alloc_s"].append(r.transfer_start_s - r.handoff_s)
        parts["transfer_s"].append(r.admitted_s - r.transfer_start_s)
        parts["admit_to_token_s"].append(times[1] - r.admitted_s)
        parts["gap_s"].append(times[1] - times[0])
        later.extend(b - a for a, b in zip(times[1:], times[2:]))
    out: dict[str, float | int | None] = {
        k: (sum(v) / len(v) if v else None) for k, v in parts.items()}
    out["num_first_gaps"] = len(parts["gap_s"])
    out["later_gap_s"] = sum(later) / len(later) if later else None
    out["num_later_gaps"] = len(later)
    return out
