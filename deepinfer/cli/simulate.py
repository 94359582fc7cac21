"""`deepinfer simulate`: run a cluster file against a `bench serve` workload in simulated time.

    deepinfer simulate --cluster cluster.yaml --workload trace:mooncake.jsonl --num-prompts 200 \
        --time-scale 0.1 --length-scale 0.05 --json sim.json --plot sim.png [--compare run.json]

Writes the same JSON and plot as `deepinfer bench serve` (plus a `simulation` section), so
`--compare` (or `deepinfer simulate ... --compare measured.json`) diffs the two in one command.
`--samples K` also runs K perturbed, seeded runs (`sim.sampling`; the cluster file's `noise`,
else the profile's measured step-time CV) and adds each metric's mean and band (`samples`);
the top-level summary stays the run the cluster file describes.
"""
from __future__ import annotations

import argparse
import json

from deepinfer.bench.workload_args import (add_report_args, add_workload_args,
                                           workload_config_from_args)


def parse_worker_overrides(items: list[str] | None) -> dict[str, int]:
    """['prefill=2', 'decode=3'] -> {'prefill': 2, 'decode': 3}."""
    out = {}
    for item in items or []:
        role, _, count = item.partition("=")
        if role not in ("colocated", "prefill", "decode") or not count.isdigit() or int(count) < 1:
            raise ValueError(f"--workers takes ROLE=N (colocated|prefill|decode, N >= 1), "
                             f"got {item!r}")
        out[role] = int(count)
    return out


def load_cluster(args):
    from deepinfer.sim.cluster_spec import load_cluster_file
    cluster = load_cluster_file(args.cluster)
    overrides = parse_worker_overrides(args.workers)
    missing = set(overrides) - {p.role for p in cluster.pools}
    if missing:
        raise ValueError(f"--workers: the cluster has no {sorted(missing)} pool")
    return cluster.with_workers(**overrides) if overrides else cluster


def register(sub) -> None:
    p = sub.add_parser("simulate", help="simulate a cluster serving a workload (no model run)")
    p.add_argument("--cluster", required=True, help="cluster file (YAML or JSON)")
    p.add_argument("--workers", action="append", metavar="ROLE=N",
                   help="resize a pool, e.g. --workers prefill=2 --workers decode=2")
    add_workload_args(p)
    o = add_report_args(p)
    o.add_argument("--compare", default=None, metavar="JSON",
                   help="a bench serve (or simulate) JSON to diff the summary against")
    o.add_argument("--samples", type=int, default=None, metavar="K",
                   help="also run K perturbed seeds (noise: the cluster's, else the profile's "
                        "measured step-time CV) and report each metric's mean and band")
    o.add_argument("--check-invariants", action="store_true",
                   help="check every scheduler's invariants after each step (slow)")
    p.set_defaults(func=run)


def add_samples(payload: dict, samples: dict, measured: dict | None) -> None:
    """Print the samples' bands (beside the measured run's values with --compare) and add
    them to the JSON as `samples`."""
    from deepinfer.bench.latency_stats import finite_json
    from deepinfer.sim.sampling import compare_bands, format_band_comparison, format_bands
    payload["samples"] = finite_json(samples)
    print(format_bands(samples))
    if measured is not None:
        print(format_band_comparison(compare_bands(samples, measured["summary"])))


def run(args: argparse.Namespace) -> int:
    from deepinfer.bench.latency_stats import format_summary
    from deepinfer.cli.main import CLIError
    from deepinfer.sim.sim_report import (compare_runs, format_comparison, run_simulation,
                                          to_bench_json)

    try:
        cluster = load_cluster(args)
        workload_cfg = workload_config_from_args(args)
        measured = None
        if args.compare:
            with open(args.compare) as f:
                measured = json.load(f)
            if "summary" not in measured:
                raise ValueError(f"{args.compare} is not a bench serve / simulate JSON")
        if args.samples is not None and args.samples < 1:
            raise ValueError(f"--samples must be >= 1, got {args.samples}")
        sim_run = run_simulation(cluster, workload_cfg, check_invariants=args.check_invariants)
        samples = None
        if args.samples is not None:
            from deepinfer.sim.sampling import sample_runs, samples_report
            samples = samples_report(sample_runs(cluster, sim_run.workload, args.samples,
                                                 check_invariants=args.check_invariants))
    except (ValueError, OSError) as e:
        raise CLIError(str(e)) from None
    print(f"workload: {sim_run.workload.description}")
    print(f"cluster: {cluster.describe()} ({cluster.num_accelerators()} accelerators); "
          f"simulated {sim_run.duration_s:.1f} s in {sim_run.wall_s:.1f} s")
    summary = sim_run.summary(args.slo_ttft_ms, args.slo_tpot_ms)
    print(format_summary(summary, "Simulated Serving Result"))
    tiers = sim_run.hit_rate_by_tier()
    if tiers["device"] is not None:
        print(f"prefix hit rate: device {100 * tiers['device']:.1f}%, "
              f"store {100 * tiers['store']:.1f}%")
    for role, stats in sim_run.pool_stats().items():
        print(f"{role} pool: {stats['workers']} workers, utilisation "
              f"{100 * stats['utilization']:.1f}%, peak KV {100 * stats['peak_kv_usage']:.1f}%, "
              f"{stats['num_preemptions']} preemptions")
    payload = to_bench_json(sim_run, workload_cfg, slo_ttft_ms=args.slo_ttft_ms,
                            slo_tpot_ms=args.slo_tpot_ms, cluster_source=args.cluster)
    if measured is not None:
        print(format_comparison(compare_runs(payload, measured)))
    if samples is not None:
        add_samples(payload, samples, measured)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(payload, f, indent=1)
        print(f"wrote {args.json_path}")
    if args.plot_path:
        from deepinfer.bench.bench_plot import plot_run
        plot_run(sim_run.results, args.plot_path,
                 f"simulated {cluster.describe()}: {sim_run.workload.description}")
        print(f"wrote {args.plot_path}")
    failed = summary.num_failed
    return 0 if summary.num_completed and not failed else 1
