"""Time of `align_to_current` (relabel an EPLB plan to the current layout) before and after its
vectorization, at wide EP.

    .venv/bin/python benchmarks/eplb_align_bench.py --json benchmarks/results/eplb_align_bench.json

Shapes: DeepSeek-V3 decode (256 experts, 61 MoE layers, 288 slots) at EP144 x 2 slots (as the
simulator relabels it: one node) and EP32 x 9 slots (one node, and 4 nodes of 8 ranks as the
engine's hierarchical rebalancer passes it). Old and new plans are `plan_placement` on two Zipf
load draws. The old implementation (np.unique per rank pair, Python sort) is kept below as the
baseline; both are run alternately on the same plans and their results must be equal. Reported:
median wall and CPU (thread) seconds per call, and the load average, since the box may be
shared.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import numpy as np

from deepinfer.moe.eplb import plan_placement
from deepinfer.moe.expert_moves import align_to_current

# (name, ranks, slots per rank, nodes given to the planner, ranks_per_node given to align)
SHAPES = [("ep144x2", 144, 2, 1, None), ("ep32x9", 32, 9, 1, None),
          ("ep32x9_4nodes", 32, 9, 4, 8)]
EXPERTS, GROUPS, LAYERS = 256, 8, 61


def old_align_to_current(old, new, slots_per_rank, ranks_per_node=None):
    """align_to_current as it was before vectorization (commit 6cd5af2)."""
    old, new = np.asarray(old, dtype=np.int64), np.asarray(new, dtype=np.int64)
    num_ranks = old.shape[1] // slots_per_rank
    per_node = ranks_per_node or num_ranks
    out = np.empty_like(new)
    for layer in range(old.shape[0]):
        old_sets = old[layer].reshape(num_ranks, slots_per_rank)
        new_sets = new[layer].reshape(num_ranks, slots_per_rank)
        for start in range(0, num_ranks, per_node):
            ranks = range(start, start + per_node)
            overlap = {(a, b): _old_overlap(old_sets[a], new_sets[b]) for a in ranks for b in ranks}
            used_old, used_new = set(), set()
            for (a, b), _ in sorted(overlap.items(), key=lambda item: (-item[1], item[0])):
                if a not in used_old and b not in used_new:
                    used_old.add(a)
                    used_new.add(b)
                    out[layer, a * slots_per_rank:(a + 1) * slots_per_rank] = \
                        _old_keep(old_sets[a], new_sets[b])
    return out


def _old_overlap(a, b):
    values, counts_a = np.unique(a, return_counts=True)
    return int(np.minimum(counts_a, [np.count_nonzero(b == v) for v in values]).sum())


def _old_keep(old_slots, new_experts):
    remaining = list(new_experts)
    out = np.full(old_slots.shape[0], -1, dtype=np.int64)
    for i, expert in enumerate(old_slots):
        if expert in remaining:
            out[i] = expert
            remaining.remove(expert)
    out[out < 0] = remaining
    return out


def timed(fn, *args):
    t0, c0 = time.perf_counter(), time.thread_time()
    result = fn(*args)
    return result, time.perf_counter() - t0, time.thread_time() - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5, help="alternating old/new pairs per shape")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    load_before = os.getloadavg()
    rows = []
    print(f"load average (1/5/15 min) at start: {load_before}, cpus: {os.cpu_count()}")
    print(f"{'shape':14s} {'old s (cpu)':>16s} {'new s (cpu)':>18s} {'speedup':>8s}")
    for name, ranks, per_rank, nodes, per_node in SHAPES:
        old_loads, new_loads = rng.zipf(1.5, (2, LAYERS, EXPERTS)).astype(float)
        groups = GROUPS if nodes > 1 else 1
        old = plan_placement(old_loads, ranks * per_rank, ranks, groups, nodes).phy2log
        new = plan_placement(new_loads, ranks * per_rank, ranks, groups, nodes).phy2log
        times = {"old": ([], []), "new": ([], [])}
        for _ in range(args.repeats):
            a, wall, cpu = timed(old_align_to_current, old, new, per_rank, per_node)
            times["old"][0].append(wall)
            times["old"][1].append(cpu)
            b, wall, cpu = timed(align_to_current, old, new, per_rank, per_node)
            times["new"][0].append(wall)
            times["new"][1].append(cpu)
            if not np.array_equal(a, b):
                raise SystemExit(f"{name}: new result differs from the old one")
        med = {k: (statistics.median(w), statistics.median(c)) for k, (w, c) in times.items()}
        row = {"shape": name, "ranks": ranks, "slots_per_rank": per_rank, "experts": EXPERTS,
               "layers": LAYERS, "planner_nodes": nodes, "ranks_per_node": per_node,
               "repeats": args.repeats,
               "old_median_s": med["old"][0], "old_median_cpu_s": med["old"][1],
               "new_median_s": med["new"][0], "new_median_cpu_s": med["new"][1],
               "speedup_median": med["old"][0] / med["new"][0],
               "old_s": times["old"][0], "new_s": times["new"][0],
               "changed_slots_plan": int(np.count_nonzero(new != old)),
               "changed_slots_aligned": int(np.count_nonzero(b != old))}
        rows.append(row)
        print(f"{name:14s} {med['old'][0]:7.3f} ({med['old'][1]:6.3f}) "
              f"{med['new'][0]:9.4f} ({med['new'][1]:6.4f}) {row['speedup_median']:7.0f}x")
    load_after = os.getloadavg()
    print(f"load average at end: {load_after}")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"benchmark": "eplb_align", "seed": args.seed,
                       "loadavg_start": load_before, "loadavg_end": load_after,
                       "cpu_count": os.cpu_count(), "python": platform.python_version(),
                       "numpy": np.__version__, "note": "shared box: other helpers running",
                       "rows": rows}, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
