"""Cost of a speculative verification step vs its number of rows.

A verification step of one request runs its 1 + k tokens as k + 1 decode rows (the fused
decode stack, runtime/cpu_decode_stack.py) and computes logits for every row. This times,
on the default model (bf16, CPU), one request of M = 1..8 rows after a context of C tokens:

* `stack`: the decode stack's C call (30 layers: the GEMVs and the paged attention);
* `attention` (estimate): stack(C) - stack(C = 16) at the same M (the GEMVs do not
  depend on C);
* `lm_head`: `compute_logits` of the M rows (fp32 logits);
* `step`: the runner's whole `execute` (input build, stack, 1 sampled row) + the M-row logits
  less the 1-row logits the runner computed itself.

Median process CPU ms per call (the box is shared; CPU time is what the work costs while it
runs), and the ratio to M = 1. `--baseline-kernels DIR` builds a second engine from the C
kernels in DIR (e.g. an older tree's deepinfer/runtime/kernels) and alternates the two.

    .venv/bin/python benchmarks/verify_step_bench.py --threads 1 --json benchmarks/results/verify_step_bench.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from deepinfer.core.scheduler_output import ScheduledRequest, SchedulerOutput  # noqa: E402
from deepinfer.engine.engine_config import EngineConfig  # noqa: E402
from deepinfer.engine.llm_engine import LLMEngine  # noqa: E402
from deepinfer.runtime import cpu_kernel_build  # noqa: E402
from deepinfer.sampling_params import SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


def verify_step(rows: int, context: int, block_size: int) -> SchedulerOutput:
    """One request: `rows` new tokens after `context` cached ones (a 1 + k verification)."""
    width = -(-(context + rows) // block_size)
    ids = [(17 * i) % 30000 + 5 for i in range(rows)]
    req = ScheduledRequest("v", ids, context, list(range(1, 1 + width)), True, GREEDY, 1)
    return SchedulerOutput([req], rows)


def fill_context(engine: LLMEngine, context: int, block_size: int) -> None:
    """Write real K/V for the context (one prefill), so attention reads computed values."""
    width = -(-(context + 8) // block_size)
    ids = [(13 * i) % 30000 + 5 for i in range(context)]
    req = ScheduledRequest("v", ids, 0, list(range(1, 1 + width)), True, GREEDY, 0)
    engine.runner.execute(SchedulerOutput([req], context))


def make_engine(kernel_dir: str | None) -> LLMEngine:
    """An engine whose C kernels come from `kernel_dir` (None: this tree's)."""
    from deepinfer.runtime import cpu_decode_stack, cpu_small_batch_linear
    saved = cpu_kernel_build.KERNEL_DIR
    caches = [cpu_decode_stack.load_decode_stack_library, cpu_small_batch_linear.load_small_batch_linear]
    if kernel_dir is not None:
        from pathlib import Path
        cpu_kernel_build.KERNEL_DIR = Path(kernel_dir)
    for c in caches:
        c.cache_clear()
    try:
        engine = LLMEngine(EngineConfig(dtype="bfloat16", device="cpu", kv_cache_memory="512MiB"))
    finally:
        cpu_kernel_build.KERNEL_DIR = saved
        for c in caches:
            c.cache_clear()
    stack = getattr(engine.model.model, "decode_stack", None)
    if stack is None:
        raise SystemExit("the decode stack is not installed (DEEPINFER_DECODE_STACK off, or no compiler)")
    return engine


def measure(engine: LLMEngine, rows: int, context: int, repeats: int) -> dict[str, float]:
    block_size = engine.runner.block_size
    step = verify_step(rows, context, block_size)
    stack = engine.model.model.decode_stack
    fn = stack._fn
    spent = [0.0]

    def timed(*a):
        c = time.process_time()
        try:
            return fn(*a)
        finally:
            spent[0] += time.process_time() - c

    hidden = torch.randn(rows, stack.hidden).bfloat16()
    stack._fn = timed
    try:
        engine.runner.execute(step)  # warm
        runs = []
        for _ in range(repeats):
            spent[0] = 0.0
            c = time.process_time()
            engine.runner.execute(step)
            total = time.process_time() - c
            c = time.process_time()
            engine.model.compute_logits(hidden)
            head = time.process_time() - c
            c = time.process_time()
            engine.model.compute_logits(hidden[:1])
            head1 = time.process_time() - c
            runs.append({"stack": spent[0], "lm_head": head, "step": total + head - head1})
    finally:
        stack._fn = fn
    return {k: statistics.median(r[k] for r in runs) * 1e3 for k in runs[0]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, nargs="+", default=list(range(1, 9)))
    ap.add_argument("--contexts", type=int, nargs="+", default=[16, 100, 1000])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=2, help="alternations of the engines")
    ap.add_argument("--baseline-kernels", help="directory of C kernel sources for a second engine")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.threads < 1 or any(not 1 <= r <= 8 for r in args.rows) or min(args.contexts) < 1:
        ap.error("--threads >= 1, --rows in 1..8, --contexts >= 1")
    torch.set_num_threads(args.threads)
    engines = {"this tree": make_engine(None)}
    if args.baseline_kernels:
        engines["baseline"] = make_engine(args.baseline_kernels)
    results: dict[str, dict] = {name: {} for name in engines}
    for _ in range(args.rounds):
        for context in args.contexts:
            for name, engine in engines.items():
                fill_context(engine, context, engine.runner.block_size)
                for rows in args.rows:
                    got = measure(engine, rows, context, args.repeats)
                    key = f"ctx{context}_m{rows}"
                    prev = results[name].get(key)  # keep the lower median of the rounds
                    results[name][key] = got if prev is None else {
                        k: min(prev[k], got[k]) for k in got}
    for name, res in results.items():
        print(f"== {name}, {args.threads} thread(s): CPU ms per call (ratio to M=1)")
        for context in args.contexts:
            base = res[f"ctx{context}_m1"]
            for rows in args.rows:
                r = res[f"ctx{context}_m{rows}"]
                if context != min(args.contexts):
                    r["attention_est"] = r["stack"] - res[f"ctx{min(args.contexts)}_m{rows}"]["stack"]
                print(f"ctx {context:5d} M {rows}: step {r['step']:6.2f} ({r['step'] / base['step']:.2f}x)"
                      f"  stack {r['stack']:6.2f} ({r['stack'] / base['stack']:.2f}x)"
                      f"  lm_head {r['lm_head']:5.2f}"
                      + (f"  attention~ {r['attention_est']:5.2f}" if "attention_est" in r else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "load_avg": os.getloadavg(), "machine": platform.processor(),
                       "torch": torch.__version__, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
