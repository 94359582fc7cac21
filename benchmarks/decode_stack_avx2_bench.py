"""Decode speed of the default model with the fused C decode stack vs the per-op path, one
engine, alternating rounds.

`LLM()` as shipped (SmolLM2-135M, Q4_1 GGUF weights, bf16 activations). Each round runs, for
each mode, a batch of B greedy requests: one engine step prefills them (and samples the first
token), then the decode-only steps are timed until every request has N more tokens. The
per-op mode is the same engine with `model.model.decode_stack = None` (what
DEEPINFER_DECODE_STACK=0 gives at load), so both modes share weights, caches and threads.

Reports decode tok/s (wall) and process CPU ms per token (`time.process_time()`: all threads;
the box may be shared, so wall alone can mislead), medians over rounds, the greedy tokens of
both modes compared, and `/proc/loadavg` before and after.

    .venv/bin/python benchmarks/decode_stack_avx2_bench.py --json benchmarks/results/decode_stack_avx2.json
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from deepinfer import LLM  # noqa: E402
from deepinfer.sampling_params import SamplingParams  # noqa: E402

PROMPTS = ["def fibonacci(n):\n    ", "The capital of France is", "Once upon a time, there",
           "1, 2, 3, 4, 5,", "Repeat after me: red, green, blue,", "import numpy as np\n",
           "The quick brown fox", "Q: What is 2 + 2?\nA:"]


class _Warnings(logging.Handler):
    """Kernel self-test verdicts logged while the engine loads ("... disagrees with torch")."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return f.read().strip()


def run_batch(llm: LLM, batch: int, new_tokens: int, tag: str) -> dict:
    """One batch: prefill step untimed, then the decode steps timed."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens + 1, ignore_eos=True)
    tok = engine.tokenizer
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", tok.encode(PROMPTS[i % len(PROMPTS)]), params)
    finals = {}

    def collect(outputs):
        for o in outputs:
            if o.finished:
                finals[o.request_id] = list(o.outputs[0].token_ids)

    collect(engine.step())  # the prefill step (and each request's first token)
    steps = 0
    wall0, cpu0 = time.perf_counter(), time.process_time()
    while engine.has_unfinished_requests():
        collect(engine.step())
        steps += 1
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    tokens = batch * new_tokens
    return {"steps": steps, "tok_s": tokens / wall, "cpu_ms_per_token": 1e3 * cpu / tokens,
            "tokens": [finals[f"{tag}-{i}"] for i in range(batch)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    load_before = loadavg()
    warnings = _Warnings()
    logging.getLogger("deepinfer").addHandler(warnings)
    llm = LLM()
    logging.getLogger("deepinfer").removeHandler(warnings)
    disagree = [m for m in warnings.messages if "disagrees" in m]
    print(f"load: decode stack {'installed' if llm.engine.model.model.decode_stack else 'NOT installed'}, "
          f"'disagrees' warnings: {disagree or 'none'}")
    inner = llm.engine.model.model
    stack = inner.decode_stack
    if stack is None:
        sys.exit("the default model got no decode stack on this host: nothing to compare")
    modes = {"stack": stack, "per_op": None}
    for batch in args.batches:  # warm-up: first calls allocate, fault pages in
        for mode, value in modes.items():
            inner.decode_stack = value
            run_batch(llm, batch, 8, f"warm-{mode}-{batch}")
    samples = {(b, m): [] for b in args.batches for m in modes}
    same_tokens = True
    for r in range(args.rounds):
        for batch in args.batches:
            tokens = {}
            for mode, value in (modes.items() if r % 2 == 0 else reversed(modes.items())):
                inner.decode_stack = value
                out = run_batch(llm, batch, args.new_tokens, f"r{r}-{mode}-{batch}")
                if out["steps"] != args.new_tokens:
                    sys.exit(f"{out['steps']} decode steps, expected {args.new_tokens}: the prefill "
                             "took more than one step")
                tokens[mode] = out.pop("tokens")
                samples[(batch, mode)].append(out)
            same_tokens &= tokens["stack"] == tokens["per_op"]
    inner.decode_stack = stack

    results = []
    for batch in args.batches:
        row = {"batch": batch}
        for mode in modes:
            s = samples[(batch, mode)]
            row[mode] = {"tok_s": round(statistics.median(x["tok_s"] for x in s), 1),
                         "cpu_ms_per_token": round(statistics.median(x["cpu_ms_per_token"] for x in s), 2),
                         "tok_s_all": [round(x["tok_s"], 1) for x in s]}
        row["speedup_wall"] = round(row["stack"]["tok_s"] / row["per_op"]["tok_s"], 2)
        row["speedup_cpu"] = round(row["per_op"]["cpu_ms_per_token"] / row["stack"]["cpu_ms_per_token"], 2)
        results.append(row)
        print(f"batch {batch}: stack {row['stack']['tok_s']} tok/s ({row['stack']['cpu_ms_per_token']} "
              f"CPU ms/token), per-op {row['per_op']['tok_s']} tok/s ({row['per_op']['cpu_ms_per_token']} "
              f"CPU ms/token): x{row['speedup_wall']} wall, x{row['speedup_cpu']} CPU")
    report = {"model": "default (LLM())", "threads": torch.get_num_threads(),
              "new_tokens": args.new_tokens, "rounds": args.rounds,
              "greedy_tokens_equal": same_tokens, "load_disagrees_warnings": disagree, "results": results,
              "loadavg_before": load_before, "loadavg_after": loadavg(),
              "cpu": cpu_model() or platform.machine(),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(f"greedy tokens equal: {same_tokens}; loadavg before {load_before}, after {report['loadavg_after']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
