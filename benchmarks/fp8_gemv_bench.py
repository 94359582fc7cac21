"""GB/s of the FP8 block-scaled x bf16 GEMV (kernels/quant_linear.c) on one 4096 x 4096 matrix
shape, the old path against the new one, alternating in one run, with a plain read of the same
bytes (torch's float32 sum over them) and the bf16 small-batch GEMV of the same shape as
yardsticks, at each of `--threads`.

    .venv/bin/python benchmarks/fp8_gemv_bench.py --json benchmarks/results/fp8_gemv.json

"portable" is the instruction-set cap DEEPINFER_QUANT_ISA=portable: the per-value e4m3
conversion and float loop that AVX2-only hosts ran for FP8 before the AVX2 FP8 kernel
(kernels/quant_dot_avx2_element.h); "avx2" is that kernel. Each variant gets enough distinct
copies of the matrix to pass 128 MiB, so every call reads from memory as a decode step does;
a timing is one sweep over all copies; best and median of `--reps` rounds, variants
alternating within each round. GB/s counts the FP8 bytes (1 per weight; the float32 block
scales are 1/16384 of that).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench_report import BenchReport
from deepinfer.quant.quantized_weight import FP8_BLOCK, QuantizedWeight
from deepinfer.runtime.cpu_kernel_build import load_kernel_library
from deepinfer.runtime.cpu_quant_linear import ISA_CODES, QuantLinearKernel, quant_linear_mismatch
from deepinfer.runtime.cpu_small_batch_linear import load_small_batch_linear

COLD_BYTES = 128 << 20


def fp8_copies(n: int, k: int, gen: torch.Generator) -> list[QuantizedWeight]:
    copies = max(1, -(-COLD_BYTES // (n * k)))
    out = []
    for _ in range(copies):
        data = (torch.randn(n, k, generator=gen) * 64).to(torch.float8_e4m3fn)
        scale = torch.rand(-(-n // 128), -(-k // 128), generator=gen) / 2048
        out.append(QuantizedWeight(FP8_BLOCK, n, k, data, scale, (128, 128)))
    return out


def sweep(fn, items) -> float:
    t0 = time.perf_counter()
    for item in items:
        fn(item)
    return time.perf_counter() - t0


def run_variants(variants: dict, reps: int, kernel_names: list[str], threads: int) -> dict:
    """Rounds of every variant in turn; GB/s per variant (median, best, each round)."""
    times: dict[str, list[float]] = {v: [] for v in variants}
    with torch.inference_mode():
        for fn, items, _ in variants.values():
            sweep(fn, items)  # warm-up: page faults, thread pool
        for _ in range(reps):
            for v, (fn, items, _) in variants.items():
                times[v].append(sweep(fn, items))
    out: dict = {"threads": threads, "variants": {}}
    for v, ts in times.items():
        nbytes, calls = variants[v][2], len(variants[v][1])
        r = out["variants"][v] = {
            "median_gb_s": nbytes / statistics.median(ts) / 1e9, "best_gb_s": nbytes / min(ts) / 1e9,
            "median_us_per_call": statistics.median(ts) / calls * 1e6,
            "rounds_gb_s": [nbytes / t / 1e9 for t in ts]}
        print(f"threads {threads} {v:>13}: {r['median_gb_s']:6.2f} GB/s median (best "
              f"{r['best_gb_s']:.2f}), {r['median_us_per_call']:8.1f} us per call", flush=True)
    if len(kernel_names) == 2:
        a, b = (out["variants"][x]["median_gb_s"] for x in kernel_names)
        out["speedup_median"] = b / a
        print(f"threads {threads} {kernel_names[1]} / {kernel_names[0]}: {b / a:.2f}x")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4096, help="N, the output features")
    ap.add_argument("--cols", type=int, default=4096, help="K, the input features")
    ap.add_argument("--batch", type=int, default=1, help="M, input rows per call")
    ap.add_argument("--isas", default="portable,avx2", help="quantized-kernel caps to compare")
    ap.add_argument("--threads", default="1,2", help="thread counts to run, one after another")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    n, k = args.rows, args.cols
    lib = load_kernel_library("quant_linear")
    assert lib is not None, "the quantized kernel did not build"
    kernels = {}
    for name in args.isas.split(","):
        kernel = QuantLinearKernel(lib, ISA_CODES[name])
        with torch.inference_mode():
            problem = quant_linear_mismatch(kernel)
        assert problem is None, f"{name}: self-test failed: {problem}"
        kernels[f"fp8_{kernel.isa_name}"] = kernel
    small = load_small_batch_linear()
    gen = torch.Generator().manual_seed(0)
    weights = fp8_copies(n, k, gen)
    fp8_bytes = sum(w.data.numel() for w in weights)
    bf16 = [(torch.randn(n, k, generator=gen) / k ** 0.5).bfloat16()
            for _ in range(max(1, -(-COLD_BYTES // (n * k * 2))))]
    bf16_bytes = sum(w.numel() * 2 for w in bf16)
    reads = [w.data.view(torch.float32).view(-1) for w in weights]
    x = torch.randn(args.batch, k, generator=gen).bfloat16()
    variants = {name: (lambda w, kk=kernel: kk.linear(x, w, None), weights, fp8_bytes)
                for name, kernel in kernels.items()}
    variants["plain_read"] = (lambda f: f.sum(), reads, fp8_bytes)
    if small is not None:
        variants["bf16_gemv"] = (lambda w: small(x, w, None), bf16, bf16_bytes)
    report = BenchReport()
    result = {"shape": {"N": n, "K": k, "M": args.batch}, "copies": len(weights),
              "reps": args.reps, "by_threads": {}}
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        result["by_threads"][str(threads)] = run_variants(variants, args.reps, list(kernels), threads)
    report.finish(result, args.json)


if __name__ == "__main__":
    main()
