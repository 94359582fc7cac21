"""Time and profile single runner steps of the default model: batch-1 decode, a W1-sized
decode batch, and a 512-token prefill.

    .venv/bin/python benchmarks/perf_step_profile.py --json benchmarks/results/perf_step.json

Drives `ModelRunner.execute` with synthetic SchedulerOutputs (distinct KV blocks, context
written before it is read), so it measures the runner alone. `--env NAME=VALUE` runs the same
steps with an environment variable set for a second engine in the same process, alternating,
e.g. `--env DEEPINFER_DECODE_KERNEL=1`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from deepinfer.core.scheduler_output import ScheduledRequest, SchedulerOutput
from deepinfer.engine.engine_config import EngineConfig
from deepinfer.engine.llm_engine import LLMEngine
try:
    from deepinfer.runtime.cpu_small_batch_linear import load_small_batch_linear
except ImportError:  # a tree from before the kernel
    load_small_batch_linear = None
from deepinfer.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


def decode_step(batch: int, context: int, block_size: int, first_block: int) -> SchedulerOutput:
    """`batch` decodes of one token after `context` cached tokens, blocks disjoint per request."""
    width = -(-(context + 1) // block_size)
    scheduled = [ScheduledRequest(f"r{i}", [7 + i], context,
                                  list(range(first_block + i * width, first_block + (i + 1) * width)),
                                  True, GREEDY, 1) for i in range(batch)]
    return SchedulerOutput(scheduled, batch)


def prefill_step(tokens: int, block_size: int, first_block: int) -> SchedulerOutput:
    width = -(-tokens // block_size)
    ids = [(13 * i) % 30000 + 5 for i in range(tokens)]
    req = ScheduledRequest("p", ids, 0, list(range(first_block, first_block + width)), True, GREEDY, 0)
    return SchedulerOutput([req], tokens)


def make_engine(env: dict[str, str]) -> LLMEngine:
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    if load_small_batch_linear is not None:
        load_small_batch_linear.cache_clear()  # read its switch again
    try:
        return LLMEngine(EngineConfig(dtype="bfloat16", device="cpu", kv_cache_memory="1GiB"))
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def cases(block_size: int) -> dict[str, SchedulerOutput]:
    return {
        "decode_b1_ctx300": decode_step(1, 300, block_size, 1),
        "decode_b4_ctx300": decode_step(4, 300, block_size, 1),  # small batches: the decode stack
        "decode_b64_ctx320": decode_step(64, 320, block_size, 1),
        "prefill_512": prefill_step(512, block_size, 1),
    }


def time_case(engine: LLMEngine, step: SchedulerOutput, repeats: int) -> tuple[list[float], list[float]]:
    """Wall times and process CPU times (the box is shared: CPU time is what the step costs
    when it runs, without the time other processes held the cores)."""
    engine.runner.execute(step)  # warm
    wall, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        engine.runner.execute(step)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return wall, cpu


def split_case(engine: LLMEngine, step: SchedulerOutput, repeats: int) -> dict[str, float]:
    """Median CPU ms per step in the linear layers, the C decode kernel, SDPA, and the rest
    (the profiler does not see ctypes kernels, so they are timed by wrapping them)."""
    from deepinfer.runtime.cpu_linear_packing import PackedLinear
    import torch.nn.functional as F
    acc: dict[str, float] = {}

    def timed(key, fn):
        def call(*a, **k):
            c = time.process_time()
            try:
                return fn(*a, **k)
            finally:
                acc[key] = acc.get(key, 0.0) + time.process_time() - c
        return call

    saved = (PackedLinear.forward, F.scaled_dot_product_attention)
    PackedLinear.forward = timed("linear", PackedLinear.forward)
    # fp32 logits straight from the C GEMV at <= 8 rows (a tree without it has no such method)
    saved_logits = getattr(PackedLinear, "logits_f32", None)
    if saved_logits is not None:
        PackedLinear.logits_f32 = timed("linear", saved_logits)
    F.scaled_dot_product_attention = timed("sdpa", F.scaled_dot_product_attention)
    kernel = engine.runner.decode_kernel
    fns = dict(kernel._fns) if kernel is not None else {}
    if kernel is not None:
        kernel._fns = {d: timed("decode_kernel", f) for d, f in fns.items()}
    # The fused decode stack (runtime/cpu_decode_stack.py): the whole layer stack in one call.
    stack = getattr(getattr(engine.model, "model", None), "decode_stack", None)
    stack_fn = stack._fn if stack is not None else None
    if stack is not None:
        stack._fn = timed("decode_stack", stack_fn)
    try:
        engine.runner.execute(step)
        rows = []
        for _ in range(repeats):
            acc.clear()
            c = time.process_time()
            engine.runner.execute(step)
            rows.append({**acc, "total": time.process_time() - c})
    finally:
        PackedLinear.forward, F.scaled_dot_product_attention = saved
        if saved_logits is not None:
            PackedLinear.logits_f32 = saved_logits
        if kernel is not None:
            kernel._fns = fns
        if stack is not None:
            stack._fn = stack_fn
    keys = ["linear", "decode_kernel", "sdpa", "decode_stack", "total"]
    out = {k: statistics.median(r.get(k, 0.0) for r in rows) * 1e3 for k in keys}
    out["other"] = (out["total"] - out["linear"] - out["decode_kernel"] - out["sdpa"]
                    - out["decode_stack"])
    return out


def profile_case(engine: LLMEngine, step: SchedulerOutput, top: int, trace: str | None) -> str:
    from torch.profiler import ProfilerActivity, profile
    engine.runner.execute(step)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            engine.runner.execute(step)
    if trace:
        prof.export_chrome_trace(trace)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--env", action="append", default=[], help="NAME=VALUE for a second engine")
    ap.add_argument("--profile", action="store_true", help="print the top ops of each case")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--split", action="store_true",
                    help="CPU ms per step in linears / decode kernel / SDPA / the rest")
    ap.add_argument("--cases", default="", help="comma-separated subset of case names")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    variants = {"default": {}}
    if args.env:
        variants["with_env"] = dict(e.split("=", 1) for e in args.env)
    engines = {name: make_engine(env) for name, env in variants.items()}
    results: dict[str, dict[str, list[float]]] = {n: {} for n in engines}
    cpu_results: dict[str, dict[str, list[float]]] = {n: {} for n in engines}
    steps = cases(next(iter(engines.values())).config.block_size)
    if args.cases:
        steps = {k: v for k, v in steps.items() if k in args.cases.split(",")}
    for _ in range(args.rounds):  # alternate engines and cases
        for case, step in steps.items():
            for name, engine in engines.items():
                wall, cpu = time_case(engine, step, args.repeats)
                results[name].setdefault(case, []).extend(wall)
                cpu_results[name].setdefault(case, []).extend(cpu)
    summary = {}
    for name in engines:
        for case, times in results[name].items():
            med = statistics.median(times)
            cpu = statistics.median(cpu_results[name][case])
            extra = ""
            if case.startswith("decode"):
                batch = len(steps[case].scheduled)
                extra = f"  {batch / med:8.1f} tok/s"
            print(f"{name:9s} {case:20s} wall median {med * 1e3:8.2f} ms  min {min(times) * 1e3:8.2f} ms"
                  f"  cpu median {cpu * 1e3:8.2f} ms{extra}")
            summary.setdefault(name, {})[case] = {"median_ms": med * 1e3, "min_ms": min(times) * 1e3,
                                                  "cpu_median_ms": cpu * 1e3}
    if args.split:
        for name, engine in engines.items():
            for case, step in steps.items():
                parts = split_case(engine, step, args.repeats)
                print(f"{name:9s} {case:20s} cpu split ms: "
                      + "  ".join(f"{k} {v:.1f}" for k, v in parts.items()))
                summary.setdefault(name, {}).setdefault(case, {})["cpu_split_ms"] = parts
    if args.profile:
        for name, engine in engines.items():
            for case, step in steps.items():
                print(f"\n=== {name} {case} (3 steps) ===")
                print(profile_case(engine, step, args.top, None))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"variants": variants, "threads": torch.get_num_threads(),
                       "load_average": os.getloadavg(),
                       "torch": torch.__version__, "results": summary}, f, indent=2)


if __name__ == "__main__":
    main()
