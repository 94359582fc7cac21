"""K seeded, perturbed simulations of one workload, and the band they give per metric. Pure.

`sample_runs` runs the cluster K times with its `noise` (or, when the cluster file has none,
the default `NoiseSpec()`: the profile's measured step-time CV and the default send lag), seeds
`noise.seed + 0 .. K-1`. `samples_report` summarises every `bench serve` summary metric over
the samples as a mean and a band: min–max for fewer than `MIN_SAMPLES_FOR_PERCENTILES`
samples (a p10–p90 of five values is two of them), p10–p90 from there on.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from deepinfer.bench.latency_stats import BenchSummary
from deepinfer.bench.workloads import Workload
from deepinfer.sim.cluster_spec import ClusterSpec
from deepinfer.sim.perturbation import NoiseSpec
from deepinfer.sim.sim_report import SimRun, simulate_workload

MIN_SAMPLES_FOR_PERCENTILES = 10
LATENCY_KEYS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
LATENCY_STATS = ("mean", "p50", "p90", "p99", "max")
SCALAR_KEYS = ("duration_s", "request_throughput", "output_throughput",
               "total_token_throughput", "goodput", "slo_attainment", "num_failed")


def noise_for_samples(cluster: ClusterSpec) -> NoiseSpec:
    return cluster.noise if cluster.noise is not None else NoiseSpec()


def sample_runs(cluster: ClusterSpec, workload: Workload, num_samples: int, *,
                check_invariants: bool = False) -> list[SimRun]:
    """`num_samples` runs of `workload`, each with the cluster's noise at its own seed."""
    if num_samples < 1:
        raise ValueError("the number of samples must be >= 1")
    noise = noise_for_samples(cluster)
    return [simulate_workload(dataclasses.replace(cluster, noise=noise.with_seed(noise.seed + i)),
                              workload, check_invariants=check_invariants)
            for i in range(num_samples)]


def summary_metrics(summary: BenchSummary | dict) -> dict[str, float]:
    """Every number `bench serve` prints, flat (`output_throughput`, `ttft_ms_p50`, ...), from
    a summary or its JSON form (`bench serve` / `simulate` JSON's `summary`)."""
    data = dataclasses.asdict(summary) if isinstance(summary, BenchSummary) else summary
    out: dict[str, float] = {}
    for key in SCALAR_KEYS:
        if data.get(key) is not None:
            out[key] = float(data[key])
    for key in LATENCY_KEYS:
        stats = data.get(key) or {}
        for stat in LATENCY_STATS:
            if stats.get(stat) is not None:
                out[f"{key}_{stat}"] = float(stats[stat])
    return out


def band(values: Sequence[float]) -> dict:
    """Mean and band of one metric over the samples (NaNs, e.g. no TPOT, left out)."""
    finite = [v for v in values if not math.isnan(v)]
    if not finite:
        return {"mean": None, "lo": None, "hi": None, "kind": None, "n": 0}
    if len(finite) < MIN_SAMPLES_FOR_PERCENTILES:
        lo, hi, kind = min(finite), max(finite), "min-max"
    else:
        lo, hi = (float(v) for v in np.percentile(finite, (10, 90)))
        kind = "p10-p90"
    return {"mean": float(np.mean(finite)), "lo": lo, "hi": hi, "kind": kind,
            "n": len(finite)}


def samples_report(runs: Sequence[SimRun]) -> dict:
    """The `samples` section of a simulate JSON: noise applied, per-metric bands, and each
    sample's metrics (so a later reader can take other percentiles)."""
    per_run = [summary_metrics(r.summary()) for r in runs]
    names = [k for k in per_run[0] if all(k in m for m in per_run)]
    first = runs[0].cluster.noise
    return {
        "num_samples": len(runs),
        "seeds": [r.cluster.noise.seed for r in runs],
        "step_time_cv": dict(runs[0].simulator.step_time_cv),
        "arrival_jitter_ms": first.jitter_ms if first is not None else 0.0,
        "band": "min-max" if len(runs) < MIN_SAMPLES_FOR_PERCENTILES else "p10-p90",
        "metrics": {k: band([m[k] for m in per_run]) for k in names},
        "per_sample": per_run,
    }


SHOWN = ("output_throughput", "request_throughput", "ttft_ms_p50", "ttft_ms_p90",
         "ttft_ms_mean", "tpot_ms_p50", "tpot_ms_p90", "itl_ms_p50", "e2e_ms_p50", "duration_s")


def format_bands(report: dict, names: Sequence[str] = SHOWN) -> str:
    cvs = ", ".join(f"{role} {cv:.3f}" for role, cv in report["step_time_cv"].items())
    lines = [f"{report['num_samples']} samples (step-time CV {cvs}; send lag "
             f"{report['arrival_jitter_ms']:.2f} ms): mean and {report['band']}",
             f"{'metric':<22}{'mean':>12}{'low':>12}{'high':>12}"]
    for name in names:
        b = report["metrics"].get(name)
        if b is None or b["mean"] is None:
            continue
        lines.append(f"{name:<22}{b['mean']:>12.2f}{b['lo']:>12.2f}{b['hi']:>12.2f}")
    return "\n".join(lines)


def compare_bands(report: dict, measured_summary: dict, names: Sequence[str] = SHOWN
                  ) -> list[dict]:
    """Per metric: the samples' mean and band next to a measured run's value, the error of
    the mean (mean / measured - 1) and whether the measured value lies inside the band."""
    measured = summary_metrics(measured_summary)
    rows = []
    for name in names:
        b, m = report["metrics"].get(name), measured.get(name)
        if b is None or b["mean"] is None or m is None or math.isnan(m):
            continue
        rows.append({"metric": name, "mean": b["mean"], "lo": b["lo"], "hi": b["hi"],
                     "measured": m, "error": b["mean"] / m - 1.0 if m else None,
                     "inside": b["lo"] <= m <= b["hi"]})
    return rows


def format_band_comparison(rows: list[dict]) -> str:
    lines = [f"{'metric':<22}{'sim mean':>12}{'band':>22}{'measured':>12}{'error':>9}  inside"]
    for r in rows:
        err = "n/a" if r["error"] is None else f"{100 * r['error']:+.1f}%"
        lines.append(f"{r['metric']:<22}{r['mean']:>12.2f}{r['lo']:>10.2f} – {r['hi']:<9.2f}"
                     f"{r['measured']:>12.2f}{err:>9}  {'yes' if r['inside'] else 'no'}")
    return "\n".join(lines)
