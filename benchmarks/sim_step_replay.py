"""Is the profile right for the steps a workload makes? Replay the simulator's batches for real.

Simulates a workload on one colocated engine with a cost profile, records every batch the
engine's scheduler produced (chunk shapes), then times a sample of those batches on a real
`ModelRunner` (same threads, the profiler's synthetic requests) and prints the profile's error
per kind of step (decode-only, with prefill chunks). A gap here is the profile's (model time);
a gap in `sim_validation.py` beyond it is host work outside the model step. On a shared box
the timing is also taken in CPU seconds (one thread: mostly immune to being descheduled) and
a third of the profile's own grid steps are re-timed first, so drift of the box's speed since
the profile was measured is reported (and corrected for) separately from the profile's error.

    .venv/bin/python benchmarks/sim_step_replay.py --profile P.json --trace mooncake \\
        --num-prompts 40 --max-steps 120 --out /tmp/replay.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deepinfer.bench.workload_args import add_workload_args, workload_config_from_args  # noqa: E402
from deepinfer.core.cost_model import ChunkShape  # noqa: E402
from deepinfer.bench.workloads import build_workload  # noqa: E402
from deepinfer.sim import cluster_from_dict  # noqa: E402
from deepinfer.sim.simulator import ClusterSimulator  # noqa: E402

# shared/traces beside the checkout (/work/main) or above it (a worktree under /work/wt)
TRACE = next((p / "shared" / "traces" for p in ROOT.parents if (p / "shared" / "traces").is_dir()),
             ROOT.parent / "shared" / "traces") / "mooncake" / "conversation_trace.jsonl"


class _Recorder:
    """Wraps a step-time model and keeps every batch it was asked about."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.kv_bytes_per_token = inner.kv_bytes_per_token
        self.batches = []

    def step_time_s(self, chunks):
        self.batches.append(tuple(chunks))
        return self.inner.step_time_s(chunks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", required=True)
    parser.add_argument("--trace", default=None, metavar="PATH",
                        help="= --workload trace:PATH (bench serve's workload flags apply)")
    parser.add_argument("--max-steps", type=int, default=120, help="batches timed (sampled)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    add_workload_args(parser)
    # Without a workload: the validation's Mooncake replay (lengths x0.05, <= 768 / <= 48).
    parser.set_defaults(workload=f"trace:{TRACE}", num_prompts=40, length_scale=0.05,
                        max_input_len=768, max_output_len=48, time_scale=0.1)
    args = parser.parse_args()
    if args.trace is not None:
        args.workload = f"trace:{args.trace}"
    try:
        cfg = workload_config_from_args(args)
    except ValueError as e:
        parser.exit(2, f"sim_step_replay: {e}\n")
    workload = build_workload(cfg)
    cluster = cluster_from_dict({"cost": {"profile": args.profile},
                                 "engine": {"num_kv_blocks": 2048},
                                 "pools": {"colocated": {"workers": 1}}})
    sim = ClusterSimulator(cluster)
    worker = sim.workers["colocated-0"]
    recorder = _Recorder(worker.step_model)
    worker.step_model = recorder
    sim.run(workload.requests)
    batches = recorder.batches
    rng = random.Random(0)
    picked = sorted(rng.sample(range(len(batches)), min(args.max_steps, len(batches))))

    from deepinfer.engine.engine_config import EngineConfig
    from deepinfer.engine.llm_engine import LLMEngine
    from deepinfer.runtime.profiler import StepProfiler
    engine = LLMEngine(EngineConfig(num_threads=args.threads, num_kv_blocks=2048))
    profiler = StepProfiler(engine.runner, engine.model_config.vocab_size)
    profiler.measure(batches[picked[0]], 1, 2)  # warm the runner
    model = recorder.inner.cost_model
    # The profile's own grid steps, re-timed now: how far this box's speed is from when the
    # profile was measured (other processes' load), to tell drift from the profile's error.
    reference = []
    for sample in model.metadata.get("samples", [])[::3]:
        chunks = tuple(ChunkShape(p, x) for p, x in sample["chunks"])
        cpu0 = time.process_time()
        wall = profiler.measure(chunks, 1, 0)
        reference.append({"chunks": sample["chunks"], "profiled_s": sample["step_time_s"],
                          "wall_s": wall, "cpu_s": time.process_time() - cpu0})
    drift_cpu = statistics.median(r["cpu_s"] / r["profiled_s"] for r in reference)
    drift_wall = statistics.median(r["wall_s"] / r["profiled_s"] for r in reference)
    print(f"re-timed {len(reference)} of the profile's own steps: now / then = "
          f"{drift_cpu:.3f} (CPU time), {drift_wall:.3f} (wall)")
    rows = []
    for i in picked:
        chunks = batches[i]
        cpu0 = time.process_time()
        measured = profiler.measure(chunks, 1, 0)
        cpu = time.process_time() - cpu0  # 1 thread: robust to other processes' load
        rows.append({"step": i, "chunks": [[c.context_len, c.num_new_tokens] for c in chunks],
                     "predicted_s": model.predict(chunks), "measured_s": measured,
                     "cpu_s": cpu,
                     "kind": "decode" if all(c.num_new_tokens == 1 for c in chunks)
                     else "prefill"})
    report = {"workload": workload.description, "num_sim_steps": len(batches),
              "drift_cpu": drift_cpu, "drift_wall": drift_wall, "reference": reference,
              "num_timed": len(rows), "load_average": os.getloadavg()[0], "kinds": {}}
    for kind in ("decode", "prefill", "all"):
        sel = [r for r in rows if kind == "all" or r["kind"] == kind]
        if not sel:
            continue
        pred = sum(r["predicted_s"] for r in sel)
        meas = sum(r["measured_s"] for r in sel)
        cpu = sum(r["cpu_s"] for r in sel)
        errs = [r["predicted_s"] / r["cpu_s"] - 1 for r in sel]
        report["kinds"][kind] = {"num": len(sel), "predicted_total_s": pred,
                                 "measured_total_s": meas, "cpu_total_s": cpu,
                                 "total_error_wall": pred / meas - 1,
                                 "total_error_cpu": pred / cpu - 1,
                                 "total_error_cpu_drift_corrected": pred * drift_cpu / cpu - 1,
                                 "median_error_cpu": statistics.median(errs)}
        print(f"{kind:8s} n={len(sel):4d}  predicted {pred:8.2f} s  wall {meas:8.2f} s  "
              f"cpu {cpu:8.2f} s  error vs cpu {100 * (pred / cpu - 1):+6.1f}% (median step "
              f"{100 * statistics.median(errs):+6.1f}%), vs wall {100 * (pred / meas - 1):+6.1f}%; "
              f"drift-corrected vs cpu {100 * (pred * drift_cpu / cpu - 1):+6.1f}%")
    report["rows"] = rows
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
