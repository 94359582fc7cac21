"""Prefill tokens/s of the default model (its Q4_1 GGUF linears on the CPU kernels of
kernels/quant_linear.c), prefill tiles on (unpacked weight rows reused by every input row)
against off (chunks of 8 input rows, the weight rows unpacked again per chunk), alternating
in one run on the same engine: the two paths give the same bits, so only the time differs.

    PYTHONPATH=. .venv/bin/python benchmarks/quant_prefill_bench.py > benchmarks/results/quant_prefill.json

One prompt of M tokens per run (natural text, prefix caching off, max_tokens=1), for M in
--rows, bf16 and float32 activations, 1 and 2 threads; median of --reps runs per path, wall
time and this process's CPU time (on a shared box the CPU time moves less with other jobs).
The float32 (exact) path has no tiles switch: its two columns measure the same code (noise).
JSON to stdout, progress to stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from deepinfer.llm import LLM
from deepinfer.runtime.cpu_quant_linear import load_quant_linear
from deepinfer.sampling_params import SamplingParams
from tests.integration.prompt_corpus import PARAGRAPHS

PATHS = {"tiles": True, "chunked": False}


def prompt_of(llm: LLM, num_tokens: int) -> list[int]:
    text = " ".join(PARAGRAPHS * (1 + num_tokens // 40))
    ids = llm.get_tokenizer().encode(text)
    assert len(ids) >= num_tokens, "the corpus is shorter than the prompt"
    return ids[:num_tokens]


def time_prefill(llm: LLM, prompt: list[int]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process: all its threads)"""
    params = SamplingParams(temperature=0, max_tokens=1)
    t0, c0 = time.perf_counter(), time.process_time()
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return time.perf_counter() - t0, time.process_time() - c0


def bench_dtype(dtype: str, rows: list[int], threads: list[int], reps: int) -> list[dict]:
    llm = LLM(dtype=dtype, num_threads=threads[0], seed=0, enable_prefix_caching=False,
              max_num_batched_tokens=max(2048, max(rows)))
    kernel = load_quant_linear()
    assert kernel is not None, "the quantized kernel is off on this host"
    results = []
    try:
        for num_threads in threads:
            torch.set_num_threads(num_threads)
            for m in rows:
                prompt = prompt_of(llm, m)
                for tiles in PATHS.values():  # warm-up
                    kernel.prefill_tiles = tiles
                    time_prefill(llm, prompt)
                seconds: dict[str, list[float]] = {name: [] for name in PATHS}
                cpu: dict[str, list[float]] = {name: [] for name in PATHS}
                for _ in range(reps):
                    for name, tiles in PATHS.items():
                        kernel.prefill_tiles = tiles
                        wall, used = time_prefill(llm, prompt)
                        seconds[name].append(wall)
                        cpu[name].append(used)
                row = {"dtype": dtype, "threads": num_threads, "rows": m,
                       "tokens_per_s": {n: m / statistics.median(s) for n, s in seconds.items()},
                       # per CPU-second: less sensitive to other jobs on a shared box
                       "tokens_per_cpu_s": {n: m / statistics.median(s) for n, s in cpu.items()},
                       "seconds": seconds, "cpu_seconds": cpu}
                row["speedup"] = row["tokens_per_s"]["tiles"] / row["tokens_per_s"]["chunked"]
                row["cpu_speedup"] = (row["tokens_per_cpu_s"]["tiles"]
                                      / row["tokens_per_cpu_s"]["chunked"])
                results.append(row)
                print(f"{dtype} threads={num_threads} M={m}: " + "  ".join(
                    f"{n} {v:7.1f} tok/s" for n, v in row["tokens_per_s"].items())
                    + f"  x{row['speedup']:.2f}; per CPU-s " + "  ".join(
                    f"{n} {v:7.1f}" for n, v in row["tokens_per_cpu_s"].items())
                    + f"  x{row['cpu_speedup']:.2f}", file=sys.stderr, flush=True)
    finally:
        kernel.prefill_tiles = True
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="64,256,512", help="prompt lengths M")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    rows = [int(v) for v in args.rows.split(",")]
    threads = [int(v) for v in args.threads.split(",")]
    load_start = os.getloadavg()
    results = []
    with torch.inference_mode():
        for dtype in args.dtypes.split(","):
            results += bench_dtype(dtype, rows, threads, args.reps)
    json.dump({"benchmark": "quant_prefill", "results": results, "reps": args.reps,
               "isa": load_quant_linear().isa_name, "loadavg_start": load_start,
               "loadavg_end": os.getloadavg(),
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
