"""Prefill attention alone: the C kernel (runtime/cpu_prefill_kernel.py) vs torch SDPA, as
PagedAttention._prefill runs them for one layer of one chunk; with --ttft also the
default model's 512-token TTFT with the kernel on and off in one engine, alternating.

    .venv/bin/python benchmarks/prefill_attention_bench.py --threads 2 --ttft \\
        --json benchmarks/results/prefill_attention_bench.json

Shapes default to the default model (9 query heads of 64, 3 KV heads, block size 16). Each case
times both paths alternating, and reports wall ms per call, CPU ms per call (summed over threads)
and GFLOP/s from the causal FLOP count 4 * H * d * x * (P + (x + 1) / 2): per wall second, best
wall, and per CPU second (per core: on a shared box the least disturbed by other processes).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from deepinfer.runtime.cpu_prefill_kernel import load_prefill_kernel
from deepinfer.runtime.kv_cache import KVCacheSpec, PagedKVCache
from deepinfer.runtime.paged_attention import (AttentionMetadata, PagedAttention,
                                               PrefillChunkMetadata)


def make_case(x: int, cached: int, num_heads: int, num_kv_heads: int, head_dim: int,
              block_size: int):
    """Cache, chunk metadata and q/k/v for one chunk of x tokens after `cached` ones."""
    gen = torch.Generator().manual_seed(0)
    num_blocks = -(-(cached + x) // block_size)
    spec = KVCacheSpec(1, num_kv_heads, head_dim, block_size, torch.bfloat16)
    cache = PagedKVCache(spec, num_blocks + 1, torch.device("cpu"))
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=gen))
    block_ids = torch.arange(1, num_blocks + 1)  # block 0 left unused, as the engine does
    slots = torch.arange(cached, cached + x) + block_size
    if cached:
        keys = torch.arange(cached + x)[None, :]
        queries = torch.arange(cached, cached + x)[:, None]
        chunk = PrefillChunkMetadata(0, x, cached, block_ids, keys <= queries)
    else:
        chunk = PrefillChunkMetadata(0, x, 0, None, None)
    meta = AttentionMetadata(slots, None, [chunk])
    q = torch.randn(x, num_heads, head_dim, generator=gen).bfloat16()
    k = torch.randn(x, num_kv_heads, head_dim, generator=gen).bfloat16()
    v = torch.randn(x, num_kv_heads, head_dim, generator=gen).bfloat16()
    return cache, meta, q, k, v


def time_calls(fn, repeats: int) -> tuple[list[float], list[float]]:
    fn()  # warm
    wall, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return wall, cpu


def ttft(args) -> dict:
    """512-token TTFT of the default bf16 model through `LLM.generate` (one prompt, one output
    token, prefix caching off), the kernel on and off in one engine, alternating."""
    import random

    from deepinfer import LLM, SamplingParams
    llm = LLM(model=None, dtype="bfloat16", kv_cache_memory="256MiB", seed=0,
              enable_prefix_caching=False, num_threads=args.threads)
    runner = llm.engine.runner
    kernel = runner.prefill_kernel
    if kernel is None:
        raise SystemExit("the engine did not load the prefill kernel")
    rng = random.Random(0)
    vocab = llm.get_tokenizer().vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times: dict[str, list[float]] = {"kernel": [], "sdpa": []}
    for i in range(args.ttft_rounds + 1):  # round 0 warms both paths
        for name in times:
            runner.prefill_kernel = kernel if name == "kernel" else None
            prompt = [rng.randrange(200, vocab - 200) for _ in range(args.ttft_len)]
            start = time.perf_counter()
            llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
            if i:
                times[name].append(time.perf_counter() - start)
    runner.prefill_kernel = kernel
    out = {name: {"min_s": min(t), "median_s": statistics.median(t), "all_s": t}
           for name, t in times.items()}
    print(f"{args.ttft_len}-token TTFT: kernel min {out['kernel']['min_s']:.3f} s median "
          f"{out['kernel']['median_s']:.3f} s | SDPA min {out['sdpa']['min_s']:.3f} s median "
          f"{out['sdpa']['median_s']:.3f} s")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cases", default="512:0,512:300,64:300,600:16,1024:0",
                    help="comma-separated x:P chunks")
    ap.add_argument("--heads", default="9:3:64", help="query heads:kv heads:head dim")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--ttft", action="store_true",
                    help="also the default model's TTFT through LLM.generate, kernel on vs off")
    ap.add_argument("--ttft-len", type=int, default=512)
    ap.add_argument("--ttft-rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kernel = load_prefill_kernel()
    if kernel is None:
        raise SystemExit("the prefill kernel is unavailable on this host (see the log)")
    num_heads, num_kv_heads, head_dim = (int(s) for s in args.heads.split(":"))
    results = []
    for case in args.cases.split(","):
        x, cached = (int(s) for s in case.split(":"))
        cache, meta, q, k, v = make_case(x, cached, num_heads, num_kv_heads, head_dim,
                                         args.block_size)
        paths = {"kernel": PagedAttention(cache, meta, num_heads, prefill_kernel=kernel),
                 "sdpa": PagedAttention(cache, meta, num_heads)}
        times = {name: ([], []) for name in paths}
        with torch.inference_mode():
            outs = {name: attn.forward(0, q, k, v) for name, attn in paths.items()}
            for _ in range(args.rounds):  # alternate the two paths
                for name, attn in paths.items():
                    wall, cpu = time_calls(lambda: attn.forward(0, q, k, v), args.repeats)
                    times[name][0].extend(wall)
                    times[name][1].extend(cpu)
        err = (outs["kernel"].float() - outs["sdpa"].float()).abs().max().item()
        flops = 4 * num_heads * head_dim * x * (cached + (x + 1) / 2)
        row = {"x": x, "P": cached, "heads": [num_heads, num_kv_heads, head_dim],
               "gflop": flops / 1e9, "max_abs_diff": err}
        for name, (wall, cpu) in times.items():
            med, cpu_med = statistics.median(wall), statistics.median(cpu)
            row[name] = {"wall_ms": med * 1e3, "min_ms": min(wall) * 1e3, "cpu_ms": cpu_med * 1e3,
                         "gflops_wall": flops / med / 1e9, "gflops_best": flops / min(wall) / 1e9,
                         "gflops_per_cpu_s": flops / cpu_med / 1e9}
        results.append(row)
        kern, sdpa = row["kernel"], row["sdpa"]
        print(f"x={x:5d} P={cached:5d}  kernel {kern['wall_ms']:7.2f} ms wall, {kern['cpu_ms']:7.2f} ms CPU "
              f"({kern['gflops_wall']:6.1f} GFLOP/s, best {kern['gflops_best']:6.1f}, "
              f"{kern['gflops_per_cpu_s']:6.1f} per CPU s)  sdpa {sdpa['wall_ms']:7.2f} ms wall, "
              f"{sdpa['cpu_ms']:7.2f} ms CPU ({sdpa['gflops_wall']:6.1f} GFLOP/s, "
              f"{sdpa['gflops_per_cpu_s']:6.1f} per CPU s)  CPU-time ratio "
              f"{sdpa['cpu_ms'] / kern['cpu_ms']:.2f}x  max |diff| {err:.3g}")
    ttft_results = ttft(args) if args.ttft else None
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "load_average": os.getloadavg(),
                       "torch": torch.__version__, "block_size": args.block_size,
                       "results": results, "ttft": ttft_results}, f, indent=2)


if __name__ == "__main__":
    main()
