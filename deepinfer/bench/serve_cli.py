"""`deepinfer bench serve`: build a workload, replay it against a server, report and save.

Example (W1 as a serving run):
    deepinfer bench serve --base-url http://127.0.0.1:8000 --workload random \
        --num-prompts 64 --input-len 256 --output-len 128 --json w1.json --plot w1.png
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import platform
import time

from deepinfer.bench.errors import BenchError
from deepinfer.bench.latency_stats import (finite_json, format_summary, request_columns,
                                           summarize)
from deepinfer.bench.serve_client import BenchRun, ClientConfig, run_benchmark
from deepinfer.bench.workload_args import (add_report_args, add_workload_args,
                                           workload_config_from_args)
from deepinfer.bench.workloads import WorkloadConfig, build_workload


def register(sub) -> None:
    p = sub.add_parser("serve", help="open-loop load test of an OpenAI-compatible server")
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000")
    g.add_argument("--model", default=None, help="default: the server's first model")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    g.add_argument("--endpoint", default="completions", choices=("completions", "chat"))
    g.add_argument("--prompt-format", default=None, choices=("tokens", "text"),
                   help="token-id arrays (default for completions) or detokenized text")
    g.add_argument("--tokenizer", default=None,
                   help="for --prompt-format text: HF tokenizer id/path (default: our model's)")
    g.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--max-concurrency", type=int, default=None)
    add_workload_args(p)
    o = add_report_args(p)
    o.add_argument("--no-progress", dest="progress", action="store_false")
    p.set_defaults(func=run)


def _configs(args) -> tuple[WorkloadConfig, ClientConfig]:
    workload = workload_config_from_args(args)
    if workload.kind == "images" and args.endpoint != "chat":
        raise ValueError("--workload images sends images in chat messages: add --endpoint chat")
    prompt_format = args.prompt_format or ("text" if args.endpoint == "chat" else "tokens")
    client = ClientConfig(
        base_url=args.base_url, model=args.model, api_key=args.api_key, endpoint=args.endpoint,
        prompt_format=prompt_format, ignore_eos=args.ignore_eos, temperature=args.temperature,
        max_concurrency=args.max_concurrency, show_progress=args.progress)
    return workload, client


def _detokenizer(args):
    if args.tokenizer:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    else:
        from deepinfer.runtime.model_source import resolve_model
        tokenizer = resolve_model(None).load_tokenizer()
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def run(args) -> int:
    try:
        workload_cfg, client_cfg = _configs(args)
        workload = build_workload(workload_cfg)
    except (ValueError, OSError) as e:
        raise BenchError(str(e)) from None
    print(f"workload: {workload.description}", flush=True)
    detokenize = _detokenizer(args) if client_cfg.prompt_format == "text" else None
    import httpx

    try:
        bench_run = asyncio.run(run_benchmark(client_cfg, workload.requests, detokenize))
    except (ValueError, OSError, httpx.HTTPError) as e:  # unreachable server, unknown model
        raise BenchError(f"{client_cfg.root_url}: {e}") from None
    summary = summarize(bench_run.results, bench_run.duration_s, args.slo_ttft_ms,
                        args.slo_tpot_ms)
    print(format_summary(summary))
    hit_rate = bench_run.prefix_cache_hit_rate
    print(f"Server prefix-cache hit rate (/metrics): "
          f"{'n/a' if hit_rate is None else f'{100 * hit_rate:.1f}%'}")
    errors = [r.error for r in bench_run.results if not r.success]
    if errors:
        print(f"first error ({len(errors)} failed): {errors[0]}")
    if args.json_path:
        _write_json(args, workload_cfg, workload.description, bench_run, summary)
        print(f"wrote {args.json_path}")
    if args.plot_path:
        from deepinfer.bench.bench_plot import plot_run
        plot_run(bench_run.results, args.plot_path,
                 f"{bench_run.model} @ {client_cfg.root_url}: {workload.description}")
        print(f"wrote {args.plot_path}")
    return 0 if summary.num_completed else 1


def _write_json(args, workload_cfg: WorkloadConfig, description: str, bench_run: BenchRun,
                summary) -> None:
    results = bench_run.results
    payload = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "host": platform.node(), "base_url": args.base_url, "model": bench_run.model,
        "endpoint": args.endpoint, "workload": description,
        "workload_config": {**dataclasses.asdict(workload_cfg),
                            "shrink": dataclasses.asdict(workload_cfg.shrink)},
        "summary": dataclasses.asdict(summary),
        "prefix_cache_hit_rate": bench_run.prefix_cache_hit_rate,
        "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
        "requests": request_columns(results),
    }
    with open(args.json_path, "w") as f:
        json.dump(finite_json(payload), f, indent=1)
