"""MLA's up-projections (absorb, W_UV) in bf16 vs float32 on a CPU without native bf16
matmul, end to end: a 4-layer DeepSeek-V3-shaped random model (mla_decode_bench's), one engine,
the two modes alternating every round, decode tokens per process-CPU second (the figure to
trust on a shared box at one thread) and per wall second, at batch 1 and 16.

    .venv/bin/python benchmarks/mla_up_projection_bench.py --json benchmarks/results/mla_up_projection.json
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_report import BenchReport  # noqa: E402
from mla_decode_bench import write_checkpoint  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    args = p.parse_args()

    import deepinfer.models.deepseek_v3 as ds
    from deepinfer import LLM, SamplingParams

    report = BenchReport()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="mla-up-") as root:
        llm = LLM(model=write_checkpoint(root, 4), dtype="bfloat16", kv_cache_memory="512MiB",
                  seed=0, num_threads=args.threads)
    auto = ds._float32_up_projections
    modes = {"bf16": lambda weight: False, "float32": auto}

    def run(batch: int) -> tuple[float, float]:
        prompts = [{"prompt_token_ids": [(100 + 7 * i + j) % 4000 + 3 for j in range(64)]}
                   for i in range(batch)]
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
        params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
        cpu, wall = time.process_time(), time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)  # prompts cached: decode dominates
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        return tokens / (time.process_time() - cpu), tokens / (time.perf_counter() - wall)

    rates: dict[str, list] = {}
    try:
        for _ in range(args.rounds):
            for name, choose in modes.items():
                ds._float32_up_projections = choose
                for batch in (1, 16):
                    rates.setdefault(f"{name}_batch{batch}", []).append(run(batch))
    finally:
        ds._float32_up_projections = auto
    best = {k: {"tok_per_cpu_s": round(max(r[0] for r in v), 1),
                "tok_per_wall_s": round(max(r[1] for r in v), 1)} for k, v in rates.items()}
    result = {"native_bf16_matmul": ds._native_bf16_matmul(), "threads": args.threads,
              "best": best, "rounds": rates}
    report.finish(result, args.json)
    for k, v in best.items():
        print(k, v)


if __name__ == "__main__":
    main()
