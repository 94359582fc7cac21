"""GB/s of the C bf16 GEMV (kernels/gemv_bf16.h through small_batch_linear.c) at the default
model's shapes, against a plain read of the same bytes, 1 and 2 threads, weights on 4 KiB
pages (torch's allocator) or on 2 MiB transparent huge pages (runtime/cpu_huge_pages.py);
and the LM head at one row: bf16 GEMV + the exact top-8 recompute (the old compute_logits)
against fp32 logits straight from the kernel.

    .venv/bin/python benchmarks/gemv_bandwidth_bench.py --json benchmarks/results/gemv_bandwidth.json

Each shape gets enough copies (distinct weights) to pass 128 MiB, so every call reads from
memory as a decode step does (the step reads ~270 MB of weights; L3 is 32 MiB). A timing is one
sweep over all copies; best and median of `--reps` sweeps, variants alternating.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench_report import BenchReport
from deepinfer.runtime.cpu_huge_pages import huge_page_bytes, move_to_huge_pages
from deepinfer.runtime.cpu_small_batch_linear import load_small_batch_linear

# (name, out features N, in features K) of SmolLM2-135M: hidden 576, 9 q / 3 kv heads of 64,
# intermediate 1536, vocabulary 49152 (tied head).
SHAPES = [("qkv", 960, 576), ("o_proj", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536),
          ("lm_head", 49152, 576)]
COLD_BYTES = 128 << 20


def _weights(n: int, k: int, huge: bool, gen: torch.Generator) -> list[torch.Tensor]:
    copies = max(1, -(-COLD_BYTES // (n * k * 2)))
    ws = [(torch.randn(n, k, generator=gen) / k ** 0.5).bfloat16() for _ in range(copies)]
    if huge:
        assert move_to_huge_pages(ws) > 0, "huge-page arena unavailable"
    return ws


def _sweep(fn, ws) -> float:
    t0 = time.perf_counter()
    for w in ws:
        fn(w)
    return time.perf_counter() - t0


def bench_shapes(kernel, threads: int, reps: int) -> list[dict]:
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, n, k in SHAPES:
        x = torch.randn(1, k, generator=gen).bfloat16()
        variants = {"4k_pages": _weights(n, k, False, gen), "huge_pages": _weights(n, k, True, gen)}
        nbytes = sum(w.numel() * 2 for w in variants["4k_pages"])
        # a plain read of the same bytes (torch's fp32 sum, as perf_vs_peers measures bandwidth),
        # on either kind of page
        flats = {f"plain_read_{v}": [w.view(torch.float32).view(-1) for w in ws]
                 for v, ws in variants.items()}
        times: dict[str, list[float]] = {v: [] for v in [*variants, *flats]}
        for _ in range(reps):
            for v, ws in variants.items():
                times[v].append(_sweep(lambda w: kernel(x, w, None), ws))
            for v, fs in flats.items():
                times[v].append(_sweep(lambda f: f.sum(), fs))
        row = {"shape": name, "N": n, "K": k, "copies": len(variants["4k_pages"]),
               "threads": threads, "bytes": nbytes}
        for v, ts in times.items():
            row[f"{v}_best_gb_s"] = nbytes / min(ts) / 1e9
            row[f"{v}_median_gb_s"] = nbytes / statistics.median(ts) / 1e9
            row[f"{v}_best_us_per_call"] = min(ts) / row["copies"] * 1e6
        rows.append(row)
        print(f"{name:8s} {n:6d}x{k:<5d} threads {threads}  "
              + "  ".join(f"{v} {row[f'{v}_best_gb_s']:5.1f} GB/s ({row[f'{v}_best_us_per_call']:7.1f} us)"
                          for v in times), flush=True)
        del variants, flats
    return rows


def bench_lm_head(kernel, threads: int, reps: int) -> dict:
    """One row, the tied head of the default model (one 56.6 MB weight, read from memory:
    several copies cycled so none stays in L3)."""
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(1)
    ws = _weights(49152, 576, True, gen)
    h = torch.randn(1, 576, generator=gen).bfloat16()

    def old(w):  # compute_logits before: bf16 logits, then the top 8 recomputed in fp32
        logits = kernel(h, w, None).float()
        top = logits.topk(8, dim=-1).indices
        exact = torch.bmm(w.index_select(0, top.flatten()).view(1, 8, -1).float(),
                          h.float().unsqueeze(-1)).squeeze(-1)
        return logits.scatter_(1, top, exact)

    def new(w):
        return kernel.dots_f32(h, w)

    times = {"bf16_gemv_plus_top8_recompute": [], "fp32_dots": []}
    for _ in range(reps):
        times["bf16_gemv_plus_top8_recompute"].append(_sweep(old, ws) / len(ws))
        times["fp32_dots"].append(_sweep(new, ws) / len(ws))
    out = {"threads": threads, **{f"{k}_best_ms": min(v) * 1e3 for k, v in times.items()},
           **{f"{k}_median_ms": statistics.median(v) * 1e3 for k, v in times.items()}}
    print(f"lm_head 1 row, threads {threads}: " + "  ".join(
        f"{k} best {out[f'{k}_best_ms']:.3f} ms median {out[f'{k}_median_ms']:.3f} ms" for k in times),
        flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    kernel = load_small_batch_linear()
    assert kernel is not None, "the small-batch kernel did not build or failed its self-test"
    report = BenchReport()
    result = {"shapes": [], "lm_head": []}
    with torch.inference_mode():
        for threads in [int(t) for t in args.threads.split(",")]:
            result["shapes"] += bench_shapes(kernel, threads, args.reps)
            result["lm_head"].append(bench_lm_head(kernel, threads, args.reps))
    result["anon_huge_pages_bytes"] = huge_page_bytes()
    report.finish(result, args.json)


if __name__ == "__main__":
    main()
