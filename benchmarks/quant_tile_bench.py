"""Kernel-level timing of the quantized prefill tiles (kernels/quant_tile_avx2.h): one Q4_1
linear of the default model's shapes (or the Q8_0 head's, --format q8_0), bf16 activations, M input rows, 1 thread, CPU time of
this thread. Prints numbers, asserts nothing.

    PYTHONPATH=. .venv/bin/python benchmarks/quant_tile_bench.py [--ab /work/main/deepinfer/runtime/kernels]
        [--format q8_0 --shapes "576,49152"]

--ab DIR builds DIR's quant_linear.c as well (e.g. another checkout's kernels) and alternates
the two libraries call by call in one process (same weights and inputs, outputs compared
bit for bit), printing the median of each and their ratio. On a shared box the thread's CPU
time moves less with other jobs than the wall time does.

Per shape it prints int8 GMAC/s (K x N x M multiply-adds per second of thread CPU time) and,
from the time of a few layouts of the same work, a split of the time into the per-call part
(c), the per-weight-row part that does not grow with M (the tile fill: unpacking the rows),
the per-input-row part that does not grow with N (activation quantization) and the
per-(row, weight row) part (the dots and the stores); the split is a least-squares fit
t = c + f N + a M + b M N over a grid of M and N, an estimate.
"""
from __future__ import annotations

import argparse
import ctypes
import shutil
import statistics
import time
from pathlib import Path

import torch

from deepinfer.runtime.cpu_kernel_build import KERNEL_DIR, _build
from deepinfer.runtime.cpu_quant_linear import ISA_CODES, random_blocks, weight_descriptor

_P, _INT, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
SHAPES = [(576, 1536), (1536, 576), (576, 576)]  # (K, N): gate/up, down, q/o
ROWS = [16, 32, 64, 256]


def load(kernel_dir: Path):
    compiler = shutil.which("gcc") or shutil.which("cc")
    lib = ctypes.CDLL(str(_build(kernel_dir / "quant_linear.c", compiler)))
    fn = lib.quant_linear
    fn.argtypes = [_P, _INT, _P, _INT, _I64, _INT, _P, _P, _INT, _INT, _INT]
    fn.restype = _INT
    return fn


def call(fn, desc, x, out) -> None:
    rc = fn(desc.data_ptr(), ISA_CODES["avx2"], x.data_ptr(), 0, x.stride(0), x.shape[0], None,
            out.data_ptr(), 0, 1, 0)
    assert rc == 0


def cpu_seconds(fn, desc, x, out, inner: int) -> float:
    t0 = time.thread_time()
    for _ in range(inner):
        call(fn, desc, x, out)
    return (time.thread_time() - t0) / inner


def inner_for(k: int, n: int, m: int) -> int:
    return max(3, int(4e8 / (k * n * m + 1e6)))


def case(fns: dict, fmt: str, k: int, n: int, m: int, reps: int, gen) -> dict:
    weight = random_blocks(fmt, n, k, gen)
    desc = weight_descriptor(weight)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    outs = {name: torch.empty(m, n, dtype=torch.bfloat16) for name in fns}
    inner = inner_for(k, n, m)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for name, fn in fns.items():  # warm-up
        call(fn, desc, x, outs[name])
    for _ in range(reps):
        for name, fn in fns.items():
            times[name].append(cpu_seconds(fn, desc, x, outs[name], inner))
    med = {name: statistics.median(t) for name, t in times.items()}
    first = next(iter(outs.values()))
    same = all(torch.equal(o.view(torch.int16), first.view(torch.int16)) for o in outs.values())
    return {"med": med, "same_bits": same}


def split(fn, k: int, reps: int, gen) -> list[float]:
    """Least-squares (c, f, a, b) of t = c + f N + a M + b M N (seconds) over M and N."""
    rows = []
    for n in (16, 64, 256):
        weight = random_blocks("q4_1", n, k, gen)
        desc = weight_descriptor(weight)
        for m in (16, 64, 256):
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            out = torch.empty(m, n, dtype=torch.bfloat16)
            call(fn, desc, x, out)
            t = statistics.median(cpu_seconds(fn, desc, x, out, inner_for(k, n, m))
                                  for _ in range(reps))
            rows.append((m, n, t))
    a = torch.tensor([[1.0, n, m, m * n] for m, n, _ in rows], dtype=torch.float64)
    y = torch.tensor([[t] for _, _, t in rows], dtype=torch.float64)
    return torch.linalg.lstsq(a, y).solution.flatten().tolist()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ab", type=Path, help="another kernels/ directory to alternate with")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--no-split", action="store_true")
    parser.add_argument("--format", default="q4_1", help="q4_1 (the linears), q8_0 (the head)")
    parser.add_argument("--shapes", help="K,N pairs, e.g. 576,49152 (default: the linears')")
    args = parser.parse_args()
    torch.set_num_threads(1)
    fns = {"this": load(KERNEL_DIR)}
    if args.ab:
        fns = {"other": load(args.ab), **fns}
    gen = torch.Generator().manual_seed(0)
    shapes = SHAPES if not args.shapes else [
        tuple(int(v) for v in pair.split(",")) for pair in args.shapes.split()]
    print(f"{args.format} weights, bf16 rows, 1 thread, thread CPU time, median of {args.reps}")
    for k, n in shapes:
        for m in ROWS:
            r = case(fns, args.format, k, n, m, args.reps, gen)
            macs = k * n * m
            cols = "  ".join(f"{name} {t * 1e3:8.3f} ms {macs / t / 1e9:6.2f} GMAC/s"
                             for name, t in r["med"].items())
            ratio = (f"  other/this {r['med']['other'] / r['med']['this']:.3f}"
                     if args.ab else "")
            print(f"K={k:5d} N={n:5d} M={m:4d}  {cols}{ratio}"
                  + ("" if r["same_bits"] else "  OUTPUTS DIFFER"))
    if args.no_split:
        return
    for name, fn in fns.items():
        for k in (576, 1536):
            c, f, a, b = split(fn, k, args.reps, gen)
            print(f"{name} K={k}: per call {c * 1e6:6.2f} us, per weight row (fill) "
                  f"{f * 1e9:6.1f} ns, per input row (quantize) {a * 1e9:6.1f} ns, per (row, "
                  f"weight row) {b * 1e9:6.2f} ns = {k / b / 1e9:5.2f} GMAC/s in the dots")


if __name__ == "__main__":
    main()
