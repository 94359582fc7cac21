"""Where a MoE decode step's CPU time goes: thread CPU ms per decoded token of each part.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD .venv/bin/python benchmarks/moe_decode_parts.py \
        --ckpt /tmp/qwen3moe-4l --batches 1 16

Runs greedy decode of `--batches` concurrent requests on a random checkpoint (`--ckpt`: an
existing one, e.g. a DeepSeek-V3 shape, or a Qwen3-MoE shape written there by
moe_decode_bench.write_checkpoint when missing) and wraps the runner's `execute` and the
model's modules with thread-CPU timers, counted in decode-only steps: the step, the model
forward, attention, the MoE block, its routed experts and `select_experts`. Derived parts:
moe_other (router linear, shared experts, adds), layer_rest (norms, residuals, a dense MLP)
and step_minus_forward (LM head, sampling, the runner). Thread CPU time of the main thread
moves far less than wall time on a shared box, but it misses OpenMP workers: step_process_cpu
(the process) and step_wall are printed beside it. A/B two trees by running this once per tree,
alternating, with PYTHONPATH pointing at each. Medians of `--reps` runs per batch size.
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

import torch

# appended, not first: PYTHONPATH picks which tree's deepinfer an A/B run measures
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.moe_decode_bench import write_checkpoint  # noqa: E402

TIMED = ("step_process_cpu", "step_wall", "step", "model_fwd", "attention", "moe_block",
         "experts", "routing")


class PartTimer:
    """Thread-CPU seconds per part, counted only while a decode-only step runs."""

    def __init__(self) -> None:
        self.acc: dict[str, float] = collections.defaultdict(float)
        self.on = False

    def wrap(self, owner, name: str, key: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            if not self.on:
                return inner(*args, **kwargs)
            start = time.thread_time()
            try:
                return inner(*args, **kwargs)
            finally:
                self.acc[key] += time.thread_time() - start
        setattr(owner, name, timed)

    def wrap_runner(self, runner) -> None:
        execute = runner.execute

        def timed(output):
            decode = bool(output.scheduled) and output.num_batched_tokens == len(output.scheduled)
            self.on = decode
            start, cpu, wall = time.thread_time(), time.process_time(), time.perf_counter()
            try:
                return execute(output)
            finally:
                if decode:
                    self.acc["step"] += time.thread_time() - start
                    self.acc["step_process_cpu"] += time.process_time() - cpu
                    self.acc["step_wall"] += time.perf_counter() - wall
                    self.acc["tokens"] += output.num_batched_tokens
                self.on = False
        runner.execute = timed


def install(timer: PartTimer, runner) -> None:
    import deepinfer.models.deepseek_v3 as ds
    import deepinfer.models.llama as llama
    import deepinfer.moe.layer as moe

    timer.wrap(moe.SparseMoEBlock, "forward", "moe_block")
    timer.wrap(moe.MoEExperts, "forward", "experts")
    timer.wrap(moe, "select_experts", "routing")  # SparseMoEBlock looks it up in its module
    timer.wrap(llama.LlamaAttention, "forward", "attention")
    timer.wrap(llama.LlamaModel, "forward", "model_fwd")
    timer.wrap(ds.DeepseekV3Attention, "forward", "attention")
    timer.wrap(ds.DeepseekV3Model, "forward", "model_fwd")
    timer.wrap_runner(runner)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", required=True, help="checkpoint dir (a Qwen3-MoE shape is written if empty)")
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--moe-inter", type=int, default=384)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from deepinfer import LLM, SamplingParams

    if not os.path.exists(os.path.join(args.ckpt, "config.json")):
        write_checkpoint(args.ckpt, args)
    llm = LLM(model=args.ckpt, dtype="bfloat16", kv_cache_memory="256MiB", seed=0)
    timer = PartTimer()
    install(timer, llm.engine.runner)
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    for batch in args.batches:
        prompts = [{"prompt_token_ids": list(range(100 + 7 * i, 116 + 7 * i))} for i in range(batch)]
        llm.generate(prompts, params, use_tqdm=False)  # warm-up
        runs = collections.defaultdict(list)
        for _ in range(args.reps):
            timer.acc.clear()
            llm.generate(prompts, params, use_tqdm=False)
            for key in TIMED:
                runs[key].append(timer.acc[key] * 1e3 / timer.acc["tokens"])
        med = {k: statistics.median(v) for k, v in runs.items()}
        med["moe_other"] = med["moe_block"] - med["experts"] - med["routing"]
        med["layer_rest"] = med["model_fwd"] - med["moe_block"] - med["attention"]
        med["step_minus_forward"] = med["step"] - med["model_fwd"]
        print(f"batch {batch}: CPU ms/token, medians of {args.reps}: "
              + ", ".join(f"{k} {v:.3f}" for k, v in med.items()), flush=True)


if __name__ == "__main__":
    main()
