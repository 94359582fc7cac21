"""API fuzz, the long run: thousands of seeded malformed and edge-case OpenAI requests (the
generator of tests/integration/api_fuzz_cases.py) against a real `deepinfer serve`.

Prints and writes JSON: responses by status code and by mutation, every failure (a status
>= 500, a hang past the client timeout, a malformed body), engine restarts during the run,
whether KV returned to idle, and whether a greedy request still gives the same tokens after.

    .venv/bin/python benchmarks/api_fuzz.py --num-cases 3000 \\
        --out benchmarks/results/api_fuzz.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for tests.*

from tests.integration.api_fuzz_cases import CaseGenerator, run_cases  # noqa: E402
from tests.integration.serve_process import (  # noqa: E402
    SMALL_SERVER_ARGS, ServeProcess, metric, scrape_metrics, wait_for_metric,
)

GREEDY = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0,
          "return_token_ids": True}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-cases", type=int, default=3000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--timeout", type=float, default=120.0, help="per request: past it, a hang")
    p.add_argument("--base-url", default=None,
                   help="fuzz this running server (default: start a small one, 64-token context)")
    p.add_argument("--vocab-size", type=int, default=49152)
    p.add_argument("--max-model-len", type=int, default=64)
    p.add_argument("--out", default="benchmarks/results/api_fuzz.json")
    args = p.parse_args()

    server = None
    if args.base_url is None:
        server = ServeProcess(*SMALL_SERVER_ARGS)
        server.wait_ready()
    url = args.base_url or server.url
    try:
        result = fuzz(url, args)
    finally:
        if server is not None:
            server.stop()
    print(json.dumps({k: result[k] for k in ("num_cases", "by_status", "num_failures",
                                              "num_hangs", "engine_restarts",
                                              "kv_back_to_idle", "greedy_unchanged",
                                              "seconds", "cases_per_s")}, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    ok = (result["num_failures"] == 0 and result["engine_restarts"] == 0
          and result["kv_back_to_idle"] and result["greedy_unchanged"])
    return 0 if ok else 1


def fuzz(url: str, args) -> dict:
    before = httpx.post(f"{url}/v1/completions", json=GREEDY, timeout=60).json()
    samples = scrape_metrics(url)
    restarts = metric(samples, "deepinfer:engine_restarts_total")
    idle_kv = metric(samples, "deepinfer:kv_cache_usage_perc")
    cases = CaseGenerator(args.seed, args.vocab_size, args.max_model_len).cases(args.num_cases)
    start = time.monotonic()
    report = asyncio.run(run_cases(url, cases, args.concurrency, args.timeout))
    seconds = time.monotonic() - start
    kv = wait_for_metric(url, "deepinfer:kv_cache_usage_perc", lambda v: v == idle_kv)
    after = httpx.post(f"{url}/v1/completions", json=GREEDY, timeout=60).json()
    by_label: dict[str, Counter] = defaultdict(Counter)
    for r in report.results:
        by_label[r.case.label.split(":")[0]][str(r.status)] += 1
    failures = report.failures()
    latencies = sorted(r.seconds for r in report.results)
    return {
        "num_cases": len(report.results), "seed": args.seed, "concurrency": args.concurrency,
        "timeout_s": args.timeout, "by_status": report.by_status,
        "by_mutation": {k: dict(v) for k, v in sorted(by_label.items())},
        "num_failures": len(failures),
        "num_hangs": sum(1 for r in report.results if r.status == "timeout"),
        "failures": [{"label": r.case.label, "status": r.status, "path": r.case.path,
                      "body": r.case.body[:300].decode(errors="replace"),
                      "detail": r.detail[:500]} for r in failures[:50]],
        "engine_restarts": metric(scrape_metrics(url), "deepinfer:engine_restarts_total")
        - restarts,
        "kv_back_to_idle": kv == idle_kv,
        "greedy_unchanged": after["choices"][0]["token_ids"]
        == before["choices"][0]["token_ids"],
        "seconds": round(seconds, 1), "cases_per_s": round(len(cases) / seconds, 1),
        "latency_s": {"p50": latencies[len(latencies) // 2],
                      "p99": latencies[int(len(latencies) * 0.99)], "max": latencies[-1]},
    }


if __name__ == "__main__":
    raise SystemExit(main())
