"""Where a P/D request's inter-token latency goes, measured on the engine.

Starts `deepinfer serve` with P=2 / D=2 (one thread each, an empty fs store), warms it up
(4 random requests, seed 12345), replays the shrunk Mooncake conversation trace as
`sim_validation.py`'s mooncake-pd case does, and prints per decode worker, from the decode
workers' counters on /metrics (differences over the run):

- steps, running requests per step vs requests given a token per step vs requests waiting
  for their KV (a running request that got no token shows as running > served);
- the step time a token waits for, weighted by tokens (`decode_step_token_seconds`), next to
  the per-step average, and the worker-side inter-token gap (same weighting + the time
  between steps);
- per admitted request: allocation wait, pull (and the transport's own seconds: the rest is
  waiting for the step in progress to end), KV write + admission, admission -> first token;

and from the client: tokens per SSE chunk, ITL without each request's first decode gap
(prefill token -> first decode token) and that gap. With `--sim-cluster` the simulator's
run of the same workload gives its first gap and the rest too. Counts do not depend on the
box's load; seconds do (the load average is printed).

    .venv/bin/python benchmarks/pd_itl_breakdown.py --out /tmp/pd_itl.json \
        [--sim-cluster /tmp/gap/sim.yaml]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.sim_validation import TRACE  # noqa: E402
from benchmarks.sim_validation_engine import warm_server, worker_counters  # noqa: E402
from deepinfer.bench.serve_client import run_benchmark  # noqa: E402
from deepinfer.bench.traces import ShrinkConfig  # noqa: E402
from deepinfer.bench.workloads import WorkloadConfig, build_workload  # noqa: E402


def split_itl(results) -> dict:
    """Client side: tokens per chunk; each request's first ITL (its first decode token after
    the prefill worker's) apart from the rest."""
    first, rest, tokens, chunks = [], [], 0, 0
    for r in results:
        if not r.success or not r.itl_s:
            continue
        first.append(r.itl_s[0])
        rest += r.itl_s[1:]
        tokens += r.output_len - 1
        chunks += len(r.itl_s)

    def ms(xs, f):
        return 1e3 * f(xs) if xs else None
    return {"tokens_per_chunk": tokens / chunks if chunks else None,
            "first_gap_ms_mean": ms(first, statistics.mean),
            "first_gap_ms_p50": ms(first, statistics.median),
            "rest_itl_ms_mean": ms(rest, statistics.mean),
            "rest_itl_ms_p50": ms(rest, statistics.median),
            "num_first_gaps": len(first), "num_rest": len(rest)}


def decode_breakdown(c: dict) -> dict:
    steps = c.get("engine_steps", 0.0) or 1.0
    served = c.get("decode_step_token_requests", 0.0) or 1.0
    admitted = c.get("decode_admitted_requests", 0.0) or 1.0
    return {
        "steps": c.get("engine_steps", 0.0),
        "running_per_step": c.get("decode_step_running_requests", 0.0) / steps,
        "served_per_step": c.get("decode_step_token_requests", 0.0) / steps,
        "pending_transfers_per_step": c.get("decode_step_pending_transfers", 0.0) / steps,
        "model_ms_per_step": 1e3 * c.get("model_step_seconds", 0.0) / steps,
        "loop_ms_per_step": 1e3 * c.get("loop_step_seconds", 0.0) / steps,
        "token_weighted_step_ms": 1e3 * c.get("decode_step_token_seconds", 0.0) / served,
        "worker_itl_ms": 1e3 * c.get("decode_token_gap_seconds", 0.0)
        / (c.get("decode_token_gaps", 0.0) or 1.0),
        "admitted": c.get("decode_admitted_requests", 0.0),
        "alloc_wait_ms": 1e3 * c.get("decode_alloc_wait_seconds", 0.0) / admitted,
        "pull_ms": 1e3 * c.get("decode_fetch_wait_seconds", 0.0) / admitted,
        "transport_ms": 1e3 * c.get("kv_transfer_seconds", 0.0) / admitted,
        "kv_write_ms": 1e3 * c.get("decode_kv_write_seconds", 0.0) / admitted,
        "admit_to_first_token_ms": 1e3 * c.get("decode_first_token_wait_seconds", 0.0)
        / admitted,
        "between_steps_s": c.get("between_steps_seconds", 0.0),
        "process_cpu_s": c.get("process_cpu_seconds", 0.0)}


def measure(workload) -> dict:
    store = tempfile.mkdtemp(prefix="pd-itl-store-")
    args = ["--prefill-workers", "2", "--decode-workers", "2", "--kv-store", f"fs://{store}"]
    with warm_server(args) as (_, port, config):
        load = [os.getloadavg()[0]]
        before = worker_counters(port)
        run = asyncio.run(run_benchmark(config, workload.requests))
        after = worker_counters(port)
        load.append(os.getloadavg()[0])
    workers = {w: {k: v - before.get(w, {}).get(k, 0.0) for k, v in c.items()}
               for w, c in after.items()}
    return {"load_average": load, "client": split_itl(run.results),
            "decode": {w: decode_breakdown(c) for w, c in sorted(workers.items())
                       if w.startswith("decode")}}


def simulate(cluster_path: str, workload) -> dict:
    import yaml
    from deepinfer.sim import cluster_from_dict, simulate_workload
    with open(cluster_path) as f:
        cluster = cluster_from_dict(yaml.safe_load(f))
    return {"client": split_itl(simulate_workload(cluster, workload).results)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=40)
    p.add_argument("--sim-cluster", help="also simulate the workload on this cluster file")
    p.add_argument("--out", help="write the numbers as JSON")
    args = p.parse_args(argv)
    workload = build_workload(WorkloadConfig(
        kind=f"trace:{TRACE}", num_prompts=args.num_prompts, time_scale=0.1,
        shrink=ShrinkConfig(length_scale=0.05, max_input_len=768, max_output_len=48)))
    out = {"measured": measure(workload)}
    if args.sim_cluster:
        out["simulated"] = simulate(args.sim_cluster, workload)
    m = out["measured"]
    print(f"load average {m['load_average'][0]:.1f} -> {m['load_average'][1]:.1f}")
    for w, d in m["decode"].items():
        print(f"{w}: {d['steps']:.0f} steps; per step {d['running_per_step']:.2f} running, "
              f"{d['served_per_step']:.2f} given a token, {d['pending_transfers_per_step']:.2f} "
              f"awaiting KV; model {d['model_ms_per_step']:.1f} / loop "
              f"{d['loop_ms_per_step']:.1f} ms per step, token-weighted step "
              f"{d['token_weighted_step_ms']:.1f} ms, worker ITL {d['worker_itl_ms']:.1f} ms")
        print(f"   per admission ({d['admitted']:.0f}): alloc {d['alloc_wait_ms']:.1f}, pull "
              f"{d['pull_ms']:.1f} (transport {d['transport_ms']:.1f}), write "
              f"{d['kv_write_ms']:.1f}, admit -> first token {d['admit_to_first_token_ms']:.1f} ms")
    for name, part in (("measured", m), ("simulated", out.get("simulated"))):
        if part is None:
            continue
        c = part["client"]
        print(f"client ({name}): {c['tokens_per_chunk']:.2f} tokens/chunk; first decode gap "
              f"mean {c['first_gap_ms_mean']:.1f} / p50 {c['first_gap_ms_p50']:.1f} ms "
              f"({c['num_first_gaps']}); the rest mean {c['rest_itl_ms_mean']:.1f} / p50 "
              f"{c['rest_itl_ms_p50']:.1f} ms ({c['num_rest']})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
