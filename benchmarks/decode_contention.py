"""Small decode steps' CPU cost alone vs with another model process busy on the other core.

Why: P=2/D=2 decode workers spend 3-18% more CPU per step than the cost profile
predicts for the same batch shapes, while a colocated engine, or a P=1/D=1 decode worker whose
neighbours are idle, matches it within 1%. This times decode-only batches (the fused decode
stack's range) on a one-thread runner while 0, 1 or 2 competitor processes (their own engine
and weights) loop on a 4-row decode or a 768-token prefill, and prints each condition's CPU
seconds against the profile's prediction.

    .venv/bin/python benchmarks/decode_contention.py --out /tmp/decode_contention.json

The competitors' batches are `deepinfer profile --memory-contention`'s neighbours
(bench.host_contention.MEMORY_CONTENTION_NEIGHBOURS); `--profiler-check` also runs that measurement
(`measure_memory_contention`: its steps per CPU-second ratios) and prints it beside this table.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deepinfer.core.cost_model import ChunkShape  # noqa: E402
from deepinfer.sim.step_time import load_cost_profile  # noqa: E402

# Context lengths of decode-only batches seen in a P/D run of the Azure conversation trace
# (lengths x0.25), plus uniform ones.
BATCHES = [[10, 35, 54, 640], [24, 50, 768], [37, 78, 81, 81], [10, 35, 54], [37, 78, 81],
           [10, 35, 54, 640, 100], [64] * 4, [64] * 3, [64] * 5, [300], [300] * 2, [300] * 4,
           [1024] * 4]
CONDITIONS = {"alone": [], "decode": ["decode"], "prefill": ["prefill"],
              "2x prefill": ["prefill", "prefill"]}


def _engine():
    from deepinfer.engine.engine_config import EngineConfig
    from deepinfer.engine.llm_engine import LLMEngine
    return LLMEngine(EngineConfig(num_threads=1, num_kv_blocks=2048))


def competitor(kind: str, ready: str, seconds: float) -> None:
    """Loop one batch until `seconds` pass (or the parent kills us)."""
    from deepinfer.bench.host_contention import MEMORY_CONTENTION_NEIGHBOURS
    from deepinfer.runtime.profiler import StepProfiler
    engine = _engine()
    profiler = StepProfiler(engine.runner, engine.model_config.vocab_size, seed=3)
    batch = MEMORY_CONTENTION_NEIGHBOURS[kind]
    Path(ready).touch()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        profiler.run([batch], 1, 0, warm_up_runner=False)


def measure(profiler, repeats: int) -> list[float]:
    batches = [tuple(ChunkShape(c, 1) for c in b) for b in BATCHES]
    profiler.run(batches, repeats, 1, warm_up_runner=False)
    return list(profiler.cpu_times_s)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default=str(ROOT / "benchmarks/results/sim_validation_profile.json"))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=2, help="alternate the conditions this often")
    parser.add_argument("--out", default=None)
    parser.add_argument("--profiler-check", action="store_true",
                        help="also run deepinfer profile --memory-contention's measurement")
    parser.add_argument("--competitor", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--ready", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, default=60.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.competitor:
        competitor(args.competitor, args.ready, args.seconds)
        return 0
    from deepinfer.runtime.profiler import StepProfiler
    cost = load_cost_profile(args.profile)
    engine = _engine()
    profiler = StepProfiler(engine.runner, engine.model_config.vocab_size, seed=1)
    profiler.run([(ChunkShape(64, 1), ChunkShape(0, 64))], 1, 1)  # warm the runner
    predicted = [cost.predict([ChunkShape(c, 1) for c in b]) for b in BATCHES]
    cpu: dict[str, list[list[float]]] = {name: [] for name in CONDITIONS}
    tmp = tempfile.mkdtemp(prefix="decode-contention-")
    for r in range(args.rounds):
        for name, kinds in CONDITIONS.items():
            procs, ready = [], []
            for i, kind in enumerate(kinds):
                ready.append(os.path.join(tmp, f"{r}-{name}-{i}"))
                procs.append(subprocess.Popen(
                    [sys.executable, __file__, "--competitor", kind, "--ready", ready[-1],
                     "--seconds", "120"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            deadline = time.monotonic() + 120
            while not all(os.path.exists(p) for p in ready):
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    raise SystemExit("a competitor did not start")
                time.sleep(0.2)
            try:
                cpu[name].append(measure(profiler, args.repeats))
            finally:
                for p in procs:
                    p.kill()
                    p.wait()
    load = os.getloadavg()[0]
    rows = []
    print(f"{'batch (contexts)':34s} {'pred ms':>8s} " + " ".join(f"{n:>11s}" for n in CONDITIONS))
    for i, b in enumerate(BATCHES):
        means = {n: sum(run[i] for run in cpu[n]) / len(cpu[n]) for n in CONDITIONS}
        rows.append({"contexts": b, "predicted_s": predicted[i], "cpu_s": means})
        print(f"{str(b):34s} {predicted[i] * 1e3:8.2f} "
              + " ".join(f"{means[n] * 1e3:11.2f}" for n in CONDITIONS))
    total_pred = sum(predicted)
    summary = {n: sum(r["cpu_s"][n] for r in rows) / total_pred - 1 for n in CONDITIONS}
    print("CPU vs profile, all batches: " + ", ".join(f"{n} {v:+.1%}" for n, v in summary.items())
          + f" (load average {load:.2f})")
    profiler_check = None
    if args.profiler_check:
        from deepinfer.bench.host_contention import measure_memory_contention
        profiler_check = measure_memory_contention(
            engine.runner, engine.model_config.vocab_size,
            {"num_threads": 1, "num_kv_blocks": 2048})
        print(f"deepinfer profile --memory-contention: decode_with_decode "
              f"{profiler_check['decode_with_decode']:.3f}, decode_with_prefill "
              f"{profiler_check['decode_with_prefill']:.3f} (4-row decode steps per CPU-s "
              f"with / alone; load average {profiler_check['load_average']:.2f})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"profile": args.profile, "repeats": args.repeats, "rounds": args.rounds,
                       "load_average_at_end": load, "batches": rows,
                       "cpu_vs_profile": summary,
                       **({"profiler_check": profiler_check} if profiler_check else {})},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
