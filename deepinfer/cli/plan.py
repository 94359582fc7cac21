"""`deepinfer plan`: search worker counts and the P:D ratio for the cheapest cluster that meets
TTFT p90 / TPOT p90 SLOs on a workload, by simulating every candidate.

    deepinfer plan --cluster cluster.yaml --workload trace:mooncake.jsonl --num-prompts 300 \
        --slo-ttft-ms 2000 --slo-tpot-ms 100 --max-prefill 6 --max-decode 6 \
        --json plan.json --plot plan.png
"""
from __future__ import annotations

import argparse
import json

from deepinfer.bench.workload_args import add_workload_args, workload_config_from_args


def register(sub) -> None:
    p = sub.add_parser("plan", help="cheapest worker counts / P:D ratio meeting latency SLOs")
    p.add_argument("--cluster", required=True, help="cluster file (YAML or JSON)")
    add_workload_args(p)
    g = p.add_argument_group("search")
    g.add_argument("--slo-ttft-ms", type=float, default=None, help="TTFT p90 target")
    g.add_argument("--slo-tpot-ms", type=float, default=None, help="TPOT p90 target")
    g.add_argument("--max-prefill", type=int, default=8)
    g.add_argument("--max-decode", type=int, default=8)
    g.add_argument("--max-colocated", type=int, default=16)
    g.add_argument("--accelerator-hour-cost", type=float, default=2.0)
    g.add_argument("--json", dest="json_path", default=None)
    g.add_argument("--plot", dest="plot_path", default=None,
                   help="cost per million tokens against the P:D ratio")
    p.set_defaults(func=run)


def plot_plan(result, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for meets, marker, label in ((True, "o", "meets SLOs"), (False, "x", "misses SLOs")):
        pts = [c for c in result.candidates if c.meets == meets]
        xs = [c.pd_ratio if c.pd_ratio is not None else c.workers.get("colocated", 0) for c in pts]
        ax.scatter(xs, [c.cost_per_million_tokens for c in pts], marker=marker, label=label)
        for c, x in zip(pts, xs):
            name = "/".join(str(v) for v in c.workers.values())
            ax.annotate(name, (x, c.cost_per_million_tokens), fontsize=7,
                        textcoords="offset points", xytext=(3, 3))
    best = result.best
    if best is not None:
        x = best.pd_ratio if best.pd_ratio is not None else best.workers.get("colocated", 0)
        ax.scatter([x], [best.cost_per_million_tokens], s=160, facecolors="none",
                   edgecolors="red", label="cheapest meeting SLOs")
    ax.set_xscale("log")
    ax.set_xlabel("P:D ratio (prefill / decode workers)")
    ax.set_ylabel("$ per million tokens (input + output)")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_plan(result) -> str:
    lines = [f"{'workers':<22}{'GPUs':>6}{'$/h':>9}{'TTFT p90':>11}{'TPOT p90':>11}"
             f"{'out tok/s':>11}{'$/M tok':>9}  SLO"]
    for c in result.candidates:
        name = ", ".join(f"{k}={v}" for k, v in c.workers.items())
        lines.append(f"{name:<22}{c.num_accelerators:>6}{c.cost_per_hour:>9.2f}"
                     f"{c.ttft_p90_ms:>9.0f}ms{c.tpot_p90_ms:>9.1f}ms{c.output_throughput:>11.1f}"
                     f"{c.cost_per_million_tokens:>9.3f}  {'ok' if c.meets else 'miss'}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from deepinfer.bench.workloads import build_workload
    from deepinfer.cli.main import CLIError
    from deepinfer.sim.cluster_spec import load_cluster_file
    from deepinfer.sim.planner import SLO, plan

    try:
        cluster = load_cluster_file(args.cluster)
        workload = build_workload(workload_config_from_args(args))
        slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms)
        if args.accelerator_hour_cost < 0:
            raise ValueError("--accelerator-hour-cost must be >= 0")
        result = plan(cluster, workload, slo, max_prefill=args.max_prefill,
                      max_decode=args.max_decode, max_colocated=args.max_colocated,
                      accelerator_hour_cost=args.accelerator_hour_cost)
    except (ValueError, OSError) as e:
        raise CLIError(str(e)) from None
    print(f"workload: {workload.description}")
    print(format_plan(result))
    best = result.best
    if best is None:
        print("no candidate meets the SLOs within the limits; raise --max-prefill/--max-decode")
    else:
        print(f"cheapest meeting the SLOs: {best.workers} ({best.num_accelerators} accelerators, "
              f"${best.cost_per_hour:.2f}/h, ${best.cost_per_million_tokens:.3f} per M tokens)")
    if args.json_path:
        payload = {"workload": workload.description, "cluster": args.cluster,
                   "slo": {"ttft_p90_ms": slo.ttft_p90_ms, "tpot_p90_ms": slo.tpot_p90_ms},
                   "best": best.to_dict() if best else None,
                   "candidates": [c.to_dict() for c in result.candidates]}
        with open(args.json_path, "w") as f:
            json.dump(payload, f, indent=1, default=lambda x: None)
        print(f"wrote {args.json_path}")
    if args.plot_path:
        plot_plan(result, args.plot_path, f"{args.cluster}: {workload.description}"[:150])
        print(f"wrote {args.plot_path}")
    return 0 if best is not None else 1
