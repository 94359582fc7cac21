"""Compute-aware vs token-budget scheduling on a heterogeneous open-loop workload.

Mostly short chat requests with steady decodes, plus a few 2k-4k-token prompts arriving while
they decode. Every configuration runs the identical workload (same prompts, arrival times and
output lengths; greedy, ignore_eos) through the offline engine in real time, and we report
p50/p99 TTFT, p99 inter-token latency (ITL), throughput and, for compute-aware, how well the
cost model predicted the measured step times.

    .venv/bin/python benchmarks/compute_aware_sched.py --cost-profile profile.json \
        --out-json bench_sched.json --out-plot bench_sched.png

Prints a table, writes JSON and a plot of ITL p99 against throughput. One run is a few minutes
on a 2-core CPU; do not loop it on a shared machine.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class BenchRequest:
    request_id: str
    kind: str  # "chat" | "long"
    arrival_s: float  # offset from the start of the run
    prompt_token_ids: list[int]
    max_tokens: int


def make_workload(args: argparse.Namespace, vocab_size: int) -> list[BenchRequest]:
    """Poisson chat arrivals over the window; long prompts at fixed points inside it."""
    rng = random.Random(args.seed)
    requests = []
    t = 0.0
    for i in range(args.num_chat):
        t += rng.expovariate(args.num_chat / args.window_s)
        prompt = [rng.randrange(100, vocab_size) for _ in range(rng.randint(32, 160))]
        requests.append(BenchRequest(f"chat-{i}", "chat", t, prompt,
                                     rng.randint(args.chat_output_min, args.chat_output_max)))
    for i, length in enumerate(args.long_prompt_lens):
        arrival = args.window_s * (i + 1) / (len(args.long_prompt_lens) + 1)
        prompt = [rng.randrange(100, vocab_size) for _ in range(length)]
        requests.append(BenchRequest(f"long-{i}", "long", arrival, prompt, args.long_output))
    return sorted(requests, key=lambda r: r.arrival_s)


def run_config(engine, workload: list[BenchRequest]) -> dict:
    """Drive the engine in real time; returns latency/throughput numbers."""
    from deepinfer.sampling_params import SamplingParams

    token_times: dict[str, list[float]] = {r.request_id: [] for r in workload}
    arrival_abs: dict[str, float] = {}
    pending = list(workload)
    step_pairs: list[tuple[float, float]] = []  # (predicted, measured) step seconds
    start = time.monotonic()
    while pending or engine.has_unfinished_requests():
        now = time.monotonic()
        while pending and pending[0].arrival_s <= now - start:
            r = pending.pop(0)
            arrival_abs[r.request_id] = start + r.arrival_s
            engine.add_request(r.request_id, r.prompt_token_ids,
                               SamplingParams(temperature=0.0, max_tokens=r.max_tokens,
                                              ignore_eos=True),
                               arrival_time=start + r.arrival_s)
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, min(0.05, start + pending[0].arrival_s - now)))
            continue
        outputs = engine.step()
        t = time.monotonic()
        stats = engine.get_stats()
        if stats.predicted_step_time_s is not None and stats.step_time_s > 0:
            step_pairs.append((stats.predicted_step_time_s, stats.step_time_s))
        for out in outputs:
            seen = token_times[out.request_id]
            seen.extend([t] * (len(out.outputs[0].token_ids) - len(seen)))
    end = time.monotonic()
    return summarize(workload, token_times, arrival_abs, start, end, step_pairs,
                     engine.get_stats().num_steps)


def summarize(workload, token_times, arrival_abs, start, end, step_pairs, num_steps) -> dict:
    def pct(values, q):
        return float(np.percentile(values, q)) if values else None

    ttft = {r.request_id: token_times[r.request_id][0] - arrival_abs[r.request_id]
            for r in workload}
    itl = [b - a for times in token_times.values() for a, b in zip(times, times[1:])]
    chat_ttft = [ttft[r.request_id] for r in workload if r.kind == "chat"]
    long_ttft = [ttft[r.request_id] for r in workload if r.kind == "long"]
    num_out = sum(len(v) for v in token_times.values())
    num_prompt = sum(len(r.prompt_token_ids) for r in workload)
    duration = end - start
    result = {
        "duration_s": duration,
        "num_steps": num_steps,
        "output_throughput_tok_s": num_out / duration,
        "total_throughput_tok_s": (num_out + num_prompt) / duration,
        "ttft_p50_s": pct(list(ttft.values()), 50), "ttft_p99_s": pct(list(ttft.values()), 99),
        "chat_ttft_p50_s": pct(chat_ttft, 50), "chat_ttft_p99_s": pct(chat_ttft, 99),
        "long_ttft_mean_s": statistics.fmean(long_ttft) if long_ttft else None,
        "itl_p50_s": pct(itl, 50), "itl_p99_s": pct(itl, 99), "itl_max_s": max(itl, default=None),
    }
    if step_pairs:
        errors = [abs(p - m) / m * 100 for p, m in step_pairs]
        result["step_pred_median_abs_pct_error"] = float(np.median(errors))
        result["step_pred_p90_abs_pct_error"] = float(np.percentile(errors, 90))
    return result


def build_configs(args: argparse.Namespace) -> list[dict]:
    configs = [dict(label=f"token-budget {n}", scheduler="token-budget",
                    max_num_batched_tokens=n) for n in args.token_budgets]
    configs += [dict(label=f"compute-aware {t:g} ms", scheduler="compute-aware",
                     step_time_budget_ms=t, max_num_batched_tokens=args.compute_aware_token_cap,
                     cost_profile=args.cost_profile) for t in args.time_budgets_ms]
    return configs


def print_table(results: list[dict]) -> None:
    head = (f"{'config':24s} {'tok/s out':>9s} {'tok/s all':>9s} {'TTFT p50':>9s} "
            f"{'TTFT p99':>9s} {'chat p99':>9s} {'ITL p50':>8s} {'ITL p99':>8s} {'pred err':>8s}")
    print(head)
    print("-" * len(head))
    for r in results:
        m = r["metrics"]
        err = m.get("step_pred_median_abs_pct_error")
        print(f"{r['label']:24s} {m['output_throughput_tok_s']:9.1f} "
              f"{m['total_throughput_tok_s']:9.1f} {m['ttft_p50_s']:8.2f}s "
              f"{m['ttft_p99_s']:8.2f}s {m['chat_ttft_p99_s']:8.2f}s "
              f"{m['itl_p50_s'] * 1e3:6.0f}ms {m['itl_p99_s'] * 1e3:6.0f}ms "
              f"{'' if err is None else f'{err:7.1f}%':>8s}")


def plot(results: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for policy, marker in (("token-budget", "o"), ("compute-aware", "s")):
        rows = [r for r in results if r["scheduler"] == policy]
        xs = [r["metrics"]["total_throughput_tok_s"] for r in rows]
        ys = [r["metrics"]["itl_p99_s"] * 1e3 for r in rows]
        ax.plot(xs, ys, marker=marker, linestyle="-", label=policy)
        for r, x, y in zip(rows, xs, ys):
            ax.annotate(r["label"].split(" ", 1)[1], (x, y), textcoords="offset points",
                        xytext=(4, 4), fontsize=7)
    ax.set_xlabel("throughput (prompt + output tokens / s)")
    ax.set_ylabel("ITL p99 (ms)")
    ax.set_title("Inter-token latency vs throughput")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=1,
                   help="intra-op threads (1: on a shared 2-core box, 2-thread OpenMP stalls "
                        "whenever another process runs)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--cost-profile", default=None,
                   help="profile JSON for compute-aware (default: the cached start-up profile)")
    p.add_argument("--token-budgets", type=lambda s: [int(v) for v in s.split(",")],
                   default=[128, 512, 2048])
    p.add_argument("--time-budgets-ms", type=lambda s: [float(v) for v in s.split(",")],
                   default=[100.0, 200.0, 400.0])
    p.add_argument("--compute-aware-token-cap", type=int, default=8192,
                   help="max_num_batched_tokens for compute-aware runs (memory cap only)")
    p.add_argument("--num-chat", type=int, default=40)
    p.add_argument("--chat-output-min", type=int, default=24)
    p.add_argument("--chat-output-max", type=int, default=48)
    p.add_argument("--long-prompt-lens", type=lambda s: [int(v) for v in s.split(",")],
                   default=[2048, 3072, 4096])
    p.add_argument("--long-output", type=int, default=8)
    p.add_argument("--window-s", type=float, default=20.0, help="arrival window (seconds)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-json", default="compute_aware_sched.json")
    p.add_argument("--out-plot", default="compute_aware_sched.png")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from deepinfer.engine.engine_config import EngineConfig
    from deepinfer.engine.llm_engine import LLMEngine
    from deepinfer.runtime.model_source import load_model, resolve_model

    torch.set_num_threads(args.threads)
    source = resolve_model(None)
    model = load_model(source, getattr(torch, args.dtype))
    tokenizer = source.load_tokenizer()
    workload = make_workload(args, source.config.vocab_size)
    load_at_start = os.getloadavg()[0]  # other processes skew CPU timings: record it
    print(f"workload: {sum(r.kind == 'chat' for r in workload)} chat + "
          f"{sum(r.kind == 'long' for r in workload)} long prompts "
          f"({args.long_prompt_lens}) over {args.window_s:g} s; {args.threads} threads",
          file=sys.stderr)
    results = []
    for cfg in build_configs(args):
        label = cfg.pop("label")
        config = EngineConfig(dtype=args.dtype, num_threads=args.threads,
                              kv_cache_memory="1GiB", max_num_seqs=64, **cfg)
        engine = LLMEngine(config, source=source, model=model, tokenizer=tokenizer)
        print(f"running {label} ...", file=sys.stderr)
        metrics = run_config(engine, workload)
        results.append({"label": label, **cfg, "metrics": metrics})
        del engine
    print_table(results)
    report = {"benchmark": "compute_aware_sched", "args": vars(args),
              "load_average_at_start": load_at_start, "load_average_at_end": os.getloadavg()[0],
              "workload": [dict(asdict(r), prompt_token_ids=len(r.prompt_token_ids))
                           for r in workload],
              "results": results}
    with open(args.out_json, "w") as f:
        json.dump(report, f, indent=1)
    plot(results, args.out_plot)
    print(f"wrote {args.out_json} and {args.out_plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
