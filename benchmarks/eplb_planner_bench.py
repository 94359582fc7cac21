"""Balancedness of DeepInfer's EPLB planner against DeepSeek's published planner.

    python benchmarks/eplb_planner_bench.py --deepseek-eplb /path/to/deepseek-ai/EPLB/eplb.py \
        --json benchmarks/results/eplb_planner.json

DeepSeek's `eplb.py` (github.com/deepseek-ai/EPLB, needs torch) is loaded from the path given;
without it only DeepInfer's planner is measured. Loads per layer are drawn from Zipf, lognormal
and uniform distributions; the "next window" is the same loads times lognormal(0, 0.3) noise,
i.e. how a plan made from one window's counts serves the next (mean over --next-draws draws).
Balancedness = mean rank load / max rank load, averaged over layers (1.0 is perfect).

The comparison with DeepSeek is paired: both plans are scored on the same next-window draws,
and the difference (ours - DeepSeek) is reported with its standard error over the layers (each
layer's difference averaged over the draws first: the layers' loads are the independent
samples, the draws only average the noise out). Planning time is wall and CPU (thread) time
for all layers of a shape, measured on whatever else the machine runs.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import time

import numpy as np

from deepinfer.moe.eplb import balancedness, plan_placement

# (experts, groups, nodes, ranks, redundant slots): DeepSeek-V3-like and small shapes.
SHAPES = [(256, 8, 4, 32, 0), (256, 8, 4, 32, 32), (256, 8, 4, 32, 64), (64, 8, 2, 8, 16),
          (66, 6, 3, 6, 6), (16, 4, 2, 4, 4)]


def draw_loads(kind: str, rng, num_layers: int, num_experts: int) -> np.ndarray:
    if kind == "zipf":
        return rng.zipf(1.5, (num_layers, num_experts)).astype(float)
    if kind == "lognormal":
        return rng.lognormal(0.0, 1.0, (num_layers, num_experts))
    return rng.integers(0, 100, (num_layers, num_experts)).astype(float)


def ds_balancedness(ds, loads, num_physical, groups, nodes, ranks) -> tuple:
    import torch

    phy2log, _, logcnt = ds.rebalance_experts(torch.tensor(loads), num_physical, groups, nodes,
                                              ranks)
    phy2log, logcnt = phy2log.numpy(), logcnt.numpy()

    def score(window):
        slot = np.take_along_axis(window / logcnt, phy2log, 1)
        return balancedness(slot.reshape(window.shape[0], ranks, -1).sum(-1))
    return score


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deepseek-eplb", help="path to DeepSeek's eplb.py (optional)")
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--next-draws", type=int, default=256)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    ds = None
    if args.deepseek_eplb:
        spec = importlib.util.spec_from_file_location("deepseek_eplb", args.deepseek_eplb)
        ds = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(ds)
    rng = np.random.default_rng(args.seed)
    rows = []
    print(f"{'loads':9s} {'E':>4} {'G':>2} {'nodes':>5} {'ranks':>5} {'extra':>5} | "
          f"{'ours':>6} {'ds':>6} | {'next ours':>9} {'next ds':>7} | {'next diff +- SE':>18} "
          f"| plan ms (cpu)")
    for kind in ("zipf", "lognormal", "uniform"):
        for experts, groups, nodes, ranks, extra in SHAPES:
            loads = draw_loads(kind, rng, args.layers, experts)
            nexts = [loads * rng.lognormal(0.0, 0.3, loads.shape) for _ in range(args.next_draws)]
            t0, c0 = time.perf_counter(), time.thread_time()
            plan = plan_placement(loads, experts + extra, ranks, groups, nodes)
            plan_ms = (time.perf_counter() - t0) * 1e3
            plan_cpu_ms = (time.thread_time() - c0) * 1e3
            row = dict(loads=kind, experts=experts, groups=groups, nodes=nodes, ranks=ranks,
                       redundant=extra, plan_ms=round(plan_ms, 1),
                       plan_cpu_ms=round(plan_cpu_ms, 1),
                       ours=float(plan.balancedness(loads).mean()),
                       ours_next=float(np.mean([plan.balancedness(n).mean() for n in nexts])))
            if ds is not None:
                score = ds_balancedness(ds, loads, experts + extra, groups, nodes, ranks)
                row["deepseek"] = float(score(loads).mean())
                row["deepseek_next"] = float(np.mean([score(n).mean() for n in nexts]))
                row["layers_ours_worse"] = int((plan.balancedness(loads)
                                                < score(loads) - 1e-9).sum())
                # Paired: [draws, layers] differences on the same next windows.
                diff = np.stack([plan.balancedness(n) - score(n) for n in nexts]).mean(0)
                row["next_diff"] = float(diff.mean())
                row["next_diff_se"] = float(diff.std(ddof=1) / np.sqrt(len(diff)))
                row["layers_next_worse"] = int((diff < 0).sum())
            rows.append(row)
            print(f"{kind:9s} {experts:4d} {groups:2d} {nodes:5d} {ranks:5d} {extra:5d} | "
                  f"{row['ours']:6.4f} {row.get('deepseek', float('nan')):6.4f} | "
                  f"{row['ours_next']:9.4f} {row.get('deepseek_next', float('nan')):7.4f} | "
                  f"{row.get('next_diff', float('nan')):+8.4f} +- "
                  f"{row.get('next_diff_se', 0):.4f} | "
                  f"{plan_ms:7.1f} ({plan_cpu_ms:.1f})")
    for key in ("ours", "deepseek", "ours_next", "deepseek_next"):
        if key in rows[0]:
            print(f"mean {key}: {np.mean([r[key] for r in rows]):.4f}")
    if "next_diff" in rows[0]:
        below = [r for r in rows if r["next_diff"] < 0]
        clear = [r for r in below if r["next_diff"] < -2 * r["next_diff_se"]]
        print(f"next window: {len(below)} of {len(rows)} shapes below DeepSeek, {len(clear)} by "
              f"more than 2 SE; planned loads: {sum(r['layers_ours_worse'] for r in rows)} "
              "layers below")
    print(f"planning, all layers of a shape: max {max(r['plan_ms'] for r in rows):.0f} ms wall, "
          f"{max(r['plan_cpu_ms'] for r in rows):.0f} ms CPU")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"layers": args.layers, "seed": args.seed, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
