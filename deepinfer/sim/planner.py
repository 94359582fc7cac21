"""Capacity planner: the cheapest worker counts (and P:D ratio) that meet latency SLOs. Pure.

Every candidate is a full simulation of the workload on the cluster resized to it. For a
disaggregated cluster, for each prefill count P (1..max) decode workers are added until the
SLOs hold; more decode workers cannot repair a TTFT miss (TTFT is decided at prefill), so a
P whose TTFT fails while TPOT holds stops early. Colocated clusters grow one instance at a
time. Cost = accelerators · $/accelerator-hour; cost per million tokens = cost per hour over
the tokens per hour the candidate served (its simulated throughput at this load).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.bench.workloads import Workload
from deepinfer.sim.cluster_spec import ClusterSpec
from deepinfer.sim.sim_report import simulate_workload


@dataclass(frozen=True)
class SLO:
    ttft_p90_ms: float | None = None
    tpot_p90_ms: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_p90_ms", "tpot_p90_ms"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive")
        if self.ttft_p90_ms is None and self.tpot_p90_ms is None:
            raise ValueError("give at least one SLO (TTFT p90 or TPOT p90)")


@dataclass(frozen=True)
class Candidate:
    workers: dict[str, int]
    num_accelerators: int
    cost_per_hour: float
    ttft_p90_ms: float
    tpot_p90_ms: float
    output_throughput: float
    total_token_throughput: float
    num_failed: int
    meets_ttft: bool
    meets_tpot: bool

    @property
    def meets(self) -> bool:
        return self.meets_ttft and self.meets_tpot and self.num_failed == 0

    @property
    def cost_per_million_tokens(self) -> float:
        per_hour = self.total_token_throughput * 3600.0
        return self.cost_per_hour / per_hour * 1e6 if per_hour else float("inf")

    @property
    def pd_ratio(self) -> float | None:
        if "prefill" not in self.workers:
            return None
        return self.workers["prefill"] / self.workers["decode"]

    def to_dict(self) -> dict:
        return {"workers": dict(self.workers), "num_accelerators": self.num_accelerators,
                "cost_per_hour": self.cost_per_hour, "ttft_p90_ms": self.ttft_p90_ms,
                "tpot_p90_ms": self.tpot_p90_ms, "output_throughput": self.output_throughput,
                "total_token_throughput": self.total_token_throughput,
                "num_failed": self.num_failed, "meets_slo": self.meets,
                "pd_ratio": self.pd_ratio, "cost_per_million_tokens": self.cost_per_million_tokens}


@dataclass
class Plan:
    slo: SLO
    candidates: list[Candidate] = field(default_factory=list)

    @property
    def best(self) -> Candidate | None:
        ok = [c for c in self.candidates if c.meets]
        return min(ok, key=lambda c: (c.cost_per_hour, c.ttft_p90_ms)) if ok else None


def evaluate(cluster: ClusterSpec, workload: Workload, slo: SLO, workers: dict[str, int],
             accelerator_hour_cost: float) -> Candidate:
    sized = cluster.with_workers(**workers)
    summary = simulate_workload(sized, workload).summary()
    ttft, tpot = summary.ttft_ms.p90, summary.tpot_ms.p90
    return Candidate(
        workers=dict(workers), num_accelerators=sized.num_accelerators(),
        cost_per_hour=sized.num_accelerators() * accelerator_hour_cost,
        ttft_p90_ms=ttft, tpot_p90_ms=tpot, output_throughput=summary.output_throughput,
        total_token_throughput=summary.total_token_throughput, num_failed=summary.num_failed,
        meets_ttft=slo.ttft_p90_ms is None or ttft <= slo.ttft_p90_ms,
        meets_tpot=slo.tpot_p90_ms is None or not tpot > slo.tpot_p90_ms)  # NaN: no TPOT


def plan(cluster: ClusterSpec, workload: Workload, slo: SLO, *, max_prefill: int = 8,
         max_decode: int = 8, max_colocated: int = 16, accelerator_hour_cost: float = 2.0
         ) -> Plan:
    if min(max_prefill, max_decode, max_colocated) < 1:
        raise ValueError("worker limits must be >= 1")
    result = Plan(slo)
    if not cluster.disaggregated:
        for n in range(1, max_colocated + 1):
            candidate = evaluate(cluster, workload, slo, {"colocated": n}, accelerator_hour_cost)
            result.candidates.append(candidate)
            if candidate.meets:
                break
        return result
    for p in range(1, max_prefill + 1):
        for d in range(1, max_decode + 1):
            candidate = evaluate(cluster, workload, slo, {"prefill": p, "decode": d},
                                 accelerator_hour_cost)
            result.candidates.append(candidate)
            if candidate.meets or (not candidate.meets_ttft and candidate.meets_tpot):
                break
    return result
