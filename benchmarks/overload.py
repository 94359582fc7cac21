"""Overload: does the server shed load with 429s and keep admitted requests within the SLO?

Against one real `deepinfer serve` (started here, with `--max-waiting-requests`):

1. capacity   closed loop at `max_num_seqs` concurrency: the saturated request rate X, and
              the TTFT / TPOT of a full batch.
2. SLO        stated from that: TTFT p99 <= (1 + W/S + 1) x full-batch e2e p50 (an admitted
              request waits behind at most W queued and S running ones, plus slack), TPOT p99
              <= 2 x full-batch TPOT p50 -- or given with --slo-ttft / --slo-tpot.
3. sustainable the highest open-loop Poisson rate (from 0.9 X, stepping down) whose admitted
              requests meet the SLO with <= 1 % rejected.
4. overload   2 x sustainable: must shed (429s) while admitted requests still meet the SLO.
5. recovery   right after, 0.5 x sustainable: how long until no more 429s and no SLO misses,
              and the SLO again for arrivals `--settle-s` after the drop.

Numbers are indicative on a shared machine. Prints a table, writes JSON:

    .venv/bin/python benchmarks/overload.py --out benchmarks/results/overload.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for tests.*

from tests.integration.serve_process import ServeProcess  # noqa: E402

VOCAB = 49152


@dataclass
class Result:
    phase: str
    arrival_s: float  # since the run started
    status: int | str
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    num_tokens: int = 0


class Load:
    def __init__(self, url: str, prompt_len: int, output_len: int, seed: int) -> None:
        self.url = url
        self.prompt_len = prompt_len
        self.output_len = output_len
        self.rng = random.Random(seed)
        self.t0 = time.monotonic()
        self.http = httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(300.0),
                                      limits=httpx.Limits(max_connections=1000))

    def _body(self) -> dict:
        # Distinct random prompts: no prefix-cache help, every request pays its prefill.
        prompt = [self.rng.randrange(100, VOCAB) for _ in range(self.prompt_len)]
        return {"prompt": prompt, "max_tokens": self.output_len, "ignore_eos": True,
                "temperature": 0, "stream": True, "return_token_ids": True}

    async def one(self, phase: str) -> Result:
        start = time.monotonic()
        result = Result(phase, start - self.t0, "error")
        first = last = None
        try:
            async with self.http.stream("POST", "/v1/completions", json=self._body()) as r:
                result.status = r.status_code
                if r.status_code != 200:
                    await r.aread()
                    return result
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        result.status = "stream_error"
                        return result
                    n = sum(len(c.get("token_ids") or []) for c in chunk["choices"])
                    if n:
                        last = time.monotonic()
                        first = first or last
                        result.num_tokens += n
        except httpx.HTTPError as e:
            result.status = f"error:{type(e).__name__}"
            return result
        if first is not None:
            result.ttft_s = first - start
            result.e2e_s = last - start
            if result.num_tokens > 1:
                result.tpot_s = (last - first) / (result.num_tokens - 1)
        return result

    async def closed_loop(self, phase: str, concurrency: int, num: int) -> list[Result]:
        queue = list(range(num))
        results = []

        async def worker() -> None:
            while queue:
                queue.pop()
                results.append(await self.one(phase))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results

    def open_loop(self, phase: str, rate: float, duration_s: float) -> asyncio.Task:
        """Poisson arrivals at `rate` for `duration_s`; the task returns every request's
        task (callers gather them: in-flight requests outlive the phase)."""
        async def arrivals() -> list[asyncio.Task]:
            tasks, start, t = [], time.monotonic(), 0.0
            while True:
                t += self.rng.expovariate(rate)
                if t > duration_s:
                    return tasks
                await asyncio.sleep(max(0.0, start + t - time.monotonic()))
                tasks.append(asyncio.create_task(self.one(phase)))
        return asyncio.create_task(arrivals())


def pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(results: list[Result], duration_s: float, slo: dict | None) -> dict:
    ok = [r for r in results if r.status == 200 and r.ttft_s is not None]
    ttft = [r.ttft_s for r in ok]
    tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
    e2e = [r.e2e_s for r in ok]
    summary = {
        "sent": len(results), "completed": len(ok),
        "rejected_429": sum(1 for r in results if r.status == 429),
        "other_errors": sum(1 for r in results if r.status not in (200, 429)),
        "offered_rps": round(len(results) / duration_s, 3),
        "goodput_rps": round(len(ok) / duration_s, 3),
        "ttft_s": {"p50": pct(ttft, 50), "p99": pct(ttft, 99)},
        "tpot_s": {"p50": pct(tpot, 50), "p99": pct(tpot, 99)},
        "e2e_s": {"p50": pct(e2e, 50), "p99": pct(e2e, 99)},
    }
    if slo is not None:
        summary["slo_met"] = bool(ok) and summary["other_errors"] == 0 and \
            pct(ttft, 99) <= slo["ttft_p99_s"] and (not tpot or pct(tpot, 99) <= slo["tpot_p99_s"])
    return summary


async def run(args, url: str) -> dict:
    load = Load(url, args.prompt_len, args.output_len, args.seed)
    S, W, T = args.max_num_seqs, args.max_waiting, args.phase_s
    out: dict = {"config": vars(args), "command": " ".join(sys.argv)}
    await load.closed_loop("warmup", 2, 2)

    start = time.monotonic()
    cap = await load.closed_loop("capacity", S, args.capacity_requests)
    cap_s = time.monotonic() - start
    capacity = summarize(cap, cap_s, None)
    capacity_rps = capacity["completed"] / cap_s
    out["capacity"] = {**capacity, "saturated_rps": round(capacity_rps, 3)}
    slo = {"ttft_p99_s": args.slo_ttft or round((2 + W / S) * capacity["e2e_s"]["p50"], 3),
           "tpot_p99_s": args.slo_tpot or round(2 * capacity["tpot_s"]["p50"], 4)}
    out["slo"] = slo
    print(f"capacity {capacity_rps:.2f} req/s (closed loop, {S} concurrent); SLO: TTFT p99 <= "
          f"{slo['ttft_p99_s']:.2f} s, TPOT p99 <= {slo['tpot_p99_s'] * 1000:.0f} ms", flush=True)

    rate, tries, found = 0.9 * capacity_rps, [], False
    for step in range(args.max_search_steps):
        if step:
            rate *= 0.75
        tasks = await load.open_loop(f"search@{rate:.3f}", rate, T)
        summary = summarize(list(await asyncio.gather(*tasks)), T, slo)
        tries.append({"rate_rps": round(rate, 3), **summary})
        print(f"  try {rate:.2f} req/s: {summary['completed']}/{summary['sent']} ok, "
              f"{summary['rejected_429']} x 429, TTFT p99 {summary['ttft_s']['p99']}, "
              f"SLO {'met' if summary['slo_met'] else 'missed'}", flush=True)
        if summary["slo_met"] and summary["rejected_429"] <= 0.01 * summary["sent"]:
            found = True
            break
    sustainable = rate  # if none passed: the lowest tried, reported as not found
    out["sustainable"] = {"rate_rps": round(sustainable, 3), "found": found, "search": tries}

    over_task = load.open_loop("overload", 2 * sustainable, T)
    over_tasks = await over_task
    drop_time = time.monotonic() - load.t0  # the load drops here
    recovery_tasks = await load.open_loop("recovery", 0.5 * sustainable, T)
    over = list(await asyncio.gather(*over_tasks))
    recovery = list(await asyncio.gather(*recovery_tasks))
    out["overload"] = {"rate_rps": round(2 * sustainable, 3), **summarize(over, T, slo)}
    out["recovery"] = {"rate_rps": round(0.5 * sustainable, 3), **summarize(recovery, T, slo)}
    last_429 = [r.arrival_s for r in recovery if r.status == 429]
    out["recovery"]["last_429_after_drop_s"] = round(max(last_429) - drop_time, 2) \
        if last_429 else 0.0
    late = [r.arrival_s for r in recovery if r.status != 200 or r.ttft_s is None
            or r.ttft_s > slo["ttft_p99_s"] or (r.tpot_s or 0.0) > slo["tpot_p99_s"]]
    out["recovery"]["last_slo_violation_after_drop_s"] = round(max(late) - drop_time, 2) \
        if late else 0.0
    # Recovered: what arrives once the overload's backlog has had `settle_s` to drain.
    steady = [r for r in recovery if r.arrival_s >= drop_time + args.settle_s]
    out["recovery"]["steady"] = {"after_drop_s": args.settle_s,
                                 **summarize(steady, T - args.settle_s, slo)}
    out["requests"] = [asdict(r) for r in cap + over + recovery]
    await load.http.aclose()
    return out


def print_table(out: dict) -> None:
    print(f"\n{'phase':<12}{'rate':>8}{'sent':>6}{'ok':>5}{'429':>5}{'err':>5}"
          f"{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p99':>10}  SLO")
    steady = out["recovery"]["steady"]
    rows = [("sustainable", out["sustainable"]["search"][-1]), ("overload", out["overload"]),
            ("recovery", out["recovery"]),
            (f"  >{steady['after_drop_s']:.0f}s", {**steady,
                                                   "rate_rps": out["recovery"]["rate_rps"]})]
    for name, s in rows:
        ms = (lambda v: "-" if v is None else f"{v * 1000:.0f}ms")
        print(f"{name:<12}{s['rate_rps']:>8.2f}{s['sent']:>6}{s['completed']:>5}"
              f"{s['rejected_429']:>5}{s['other_errors']:>5}{ms(s['ttft_s']['p50']):>10}"
              f"{ms(s['ttft_s']['p99']):>10}{ms(s['tpot_s']['p99']):>10}  "
              f"{'met' if s.get('slo_met') else 'MISSED'}")
    print(f"recovery: last 429 {out['recovery']['last_429_after_drop_s']} s and last SLO "
          f"violation {out['recovery']['last_slo_violation_after_drop_s']} s after the load "
          "dropped")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--max-waiting", type=int, default=4, help="--max-waiting-requests")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--phase-s", type=float, default=40.0, help="seconds per open-loop phase")
    p.add_argument("--capacity-requests", type=int, default=16)
    p.add_argument("--max-search-steps", type=int, default=3)
    p.add_argument("--settle-s", type=float, default=5.0,
                   help="recovery is judged on arrivals this long after the load drops")
    p.add_argument("--slo-ttft", type=float, default=None, help="TTFT p99 SLO in s")
    p.add_argument("--slo-tpot", type=float, default=None, help="TPOT p99 SLO in s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/overload.json")
    args = p.parse_args()

    server = ServeProcess("--dtype", args.dtype, "--threads", str(args.threads),
                          "--max-model-len", "512", "--kv-cache-memory", "256MiB",
                          "--max-num-seqs", str(args.max_num_seqs),
                          "--max-waiting-requests", str(args.max_waiting))
    try:
        server.wait_ready()
        out = asyncio.run(run(args, server.url))
    finally:
        server.stop()
    print_table(out)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    shed = out["overload"]["rejected_429"] > 0
    return 0 if shed and out["overload"]["slo_met"] and out["recovery"]["steady"]["slo_met"] \
        else 1


if __name__ == "__main__":
    raise SystemExit(main())
