"""Microseconds per call of the quantized GEMV (kernels/quant_linear.c) for every format, one
instruction-set cap against another, alternating call batches in one run: a quick check that
each format's faster path is really faster on this host.

    .venv/bin/python benchmarks/quant_gemv_formats_bench.py --json benchmarks/results/quant_gemv_formats.json

One [1024, 1536] matrix per format (0.9-3 MB: in cache, so this measures compute, not memory
bandwidth), M rows of bf16 input, one thread by default; median of `--reps` batches of 10 calls.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench_report import BenchReport
from deepinfer.runtime.cpu_kernel_build import load_kernel_library
from deepinfer.runtime.cpu_quant_linear import (FORMAT_CODES, ISA_CODES, QuantLinearKernel,
                                                random_blocks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--isas", default="portable,avx2")
    ap.add_argument("--rows", type=int, default=1, help="M, input rows per call")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lib = load_kernel_library("quant_linear")
    assert lib is not None, "the quantized kernel did not build"
    kernels = {name: QuantLinearKernel(lib, ISA_CODES[name]) for name in args.isas.split(",")}
    for name, kernel in kernels.items():
        assert kernel.isa_name == name, f"this build has no {name} path"
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.rows, 1536, generator=gen).bfloat16()
    report = BenchReport()
    result: dict = {"rows": args.rows, "threads": args.threads, "formats": {}}
    with torch.inference_mode():
        for fmt in [f for f in FORMAT_CODES if f != "bf16"]:
            weight = random_blocks(fmt, 1024, 1536, gen)
            times: dict[str, list[float]] = {name: [] for name in kernels}
            for kernel in kernels.values():
                kernel.linear(x, weight, None)  # warm-up
            for _ in range(args.reps):
                for name, kernel in kernels.items():
                    t0 = time.perf_counter()
                    for _ in range(10):
                        kernel.linear(x, weight, None)
                    times[name].append((time.perf_counter() - t0) / 10 * 1e6)
            row = {name: statistics.median(ts) for name, ts in times.items()}
            result["formats"][fmt] = {"median_us": row, "rounds_us": times}
            print(f"{fmt:10s} " + "  ".join(f"{n} {v:8.0f} us" for n, v in row.items()), flush=True)
    report.finish(result, args.json)


if __name__ == "__main__":
    main()
