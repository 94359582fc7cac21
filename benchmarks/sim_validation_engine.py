"""The real-engine side of `sim_validation.py`: start `deepinfer serve`, warm it up, replay a
workload with the `bench serve` client, stop it; and read what the run cost (CPU seconds of the
front, each worker and the client) and the cluster's per-worker counters from `/metrics`.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from deepinfer.bench.latency_stats import summarize
from deepinfer.bench.serve_client import ClientConfig, run_benchmark
from deepinfer.bench.workloads import WorkloadConfig, build_workload

DEEPINFER = [str(Path(sys.executable).with_name("deepinfer"))]
NUM_KV_BLOCKS = 2048


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc, port: int, log, timeout_s: float = 600.0) -> None:
    """Poll /health until the server answers (RuntimeError if it exits or never does)."""
    import httpx
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"serve exited: {log.read()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("serve not ready")
        time.sleep(0.5)


def send_lag_ms(results, requests) -> float | None:
    """Mean of how late the client sent each request after its scheduled time (ms): the
    simulator's samples delay arrivals by this much on average."""
    lags = [1e3 * max(0.0, r.start_s - q.arrival_time_s) for r, q in zip(results, requests)]
    return sum(lags) / len(lags) if lags else None


@contextlib.contextmanager
def warm_server(extra_args: list[str]):
    """A `deepinfer serve` (one thread per engine process) ready and warmed up: yields
    (process, port, client config); stopped on exit."""
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="sim-validation-serve-", suffix=".log")
    proc = subprocess.Popen(DEEPINFER + ["serve", "--port", str(port), "--threads", "1",
                                         "--num-kv-blocks", str(NUM_KV_BLOCKS),
                                         "--enable-prompt-tokens-details", *extra_args],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        wait_ready(proc, port, log)
        config = ClientConfig(base_url=f"http://127.0.0.1:{port}", show_progress=False)
        # Warm-up (not measured): the first steps of a fresh engine pay one-off costs
        # (allocator growth, kernel selection) that the profile, measured warm, excludes.
        warm = build_workload(WorkloadConfig(kind="random", num_prompts=4, input_len=256,
                                             output_len=16, seed=12345))
        asyncio.run(run_benchmark(config, warm.requests))
        yield proc, port, config
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def serve_and_bench(extra_args: list[str], workload) -> dict:
    """Start `deepinfer serve`, replay the workload with the bench client, stop the server."""
    with warm_server(extra_args) as (proc, port, config):
        load_before = os.getloadavg()[0]
        cpu_before = process_cpu_seconds(proc.pid)
        workers_before = worker_counters(port)
        run = asyncio.run(run_benchmark(config, workload.requests))
        cpu_after = process_cpu_seconds(proc.pid)
        workers_after = worker_counters(port)
        summary = summarize(run.results, run.duration_s)
        cpu = {name: cpu_after[name] - cpu_before.get(name, 0.0) for name in cpu_after}
        return {"summary": summary, "hit_rate": run.prefix_cache_hit_rate,
                "load_average": [load_before, os.getloadavg()[0]],
                "cpu_s": cpu, "cluster_counters": cluster_counters(port),
                "workers": {w: {k: v - workers_before.get(w, {}).get(k, 0.0)
                                for k, v in c.items()} for w, c in workers_after.items()},
                "first_error": next((r.error for r in run.results if not r.success), None),
                "send_lag_ms": send_lag_ms(run.results, workload.requests),
                # Per request: which step each first token came out of (sorted), and TTFTs.
                "first_token_times_ms": sorted(1e3 * (r.start_s + r.ttft_s)
                                               for r in run.results if r.ttft_s is not None),
                "ttfts_ms": [1e3 * r.ttft_s for r in run.results if r.ttft_s is not None]}


def process_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of the server process, each of its descendants
    (workers) and this process (the client), by a stable name."""
    import psutil
    out = {"client": sum(psutil.Process().cpu_times()[:2])}
    try:
        root = psutil.Process(pid)
        procs = [("front", root)] + [(f"child-{p.pid}", p) for p in root.children(recursive=True)]
    except psutil.Error:
        return out
    for name, p in procs:
        try:
            with p.oneshot():
                out[name] = sum(p.cpu_times()[:2])
                if name != "front":
                    out[name + ":" + worker_role(p)] = out.pop(name)
        except psutil.Error:
            pass
    return out


def worker_role(p) -> str:
    """The multiprocessing name of a worker ("deepinfer-prefill-0"), if its title shows it."""
    try:
        text = " ".join(p.cmdline())
    except Exception:  # noqa: BLE001 - best effort, the pid names it anyway
        return "?"
    for role in ("prefill", "decode", "encode", "engine"):
        if role in text:
            return role
    return "worker"


def cluster_counters(port: int) -> dict[str, float]:
    """The front's per-cluster counters (/metrics), summed over workers."""
    import httpx
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("deepinfer:cluster_") and " " in line:
            name, value = line.rsplit(" ", 1)
            key = name.split("{")[0][len("deepinfer:cluster_"):]
            try:
                out[key] = out.get(key, 0.0) + float(value)
            except ValueError:
                pass
    return out


WORKER_COUNTERS = ("engine_steps_total", "model_step_seconds_total", "loop_step_seconds_total",
                   "process_cpu_seconds_total", "model_step_cpu_seconds_total",
                   "idle_wait_seconds_total", "prefilled_requests_total",
                   "prefill_computed_tokens_total", "decode_step_running_requests_total",
                   "decode_step_token_requests_total", "decode_step_pending_transfers_total",
                   "decode_step_token_seconds_total",
                   "decode_token_gap_seconds_total", "decode_token_gaps_total",
                   "decode_alloc_wait_seconds_total", "decode_fetch_wait_seconds_total",
                   "decode_kv_write_seconds_total", "decode_first_token_wait_seconds_total",
                   "decode_admitted_requests_total", "between_steps_seconds_total",
                   "kv_transfer_seconds_total")


def worker_counters(port: int) -> dict[str, dict[str, float]]:
    """Per worker (P/D clusters): engine steps, the runner's seconds in them, the loop's wall
    seconds around them and the process's CPU seconds, from the front's /metrics."""
    import httpx
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    except httpx.HTTPError:
        return {}
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        if not line.startswith("deepinfer:cluster_") or 'worker_id="' not in line:
            continue
        name, value = line.rsplit(" ", 1)
        key = name.split("{")[0][len("deepinfer:cluster_"):]
        if key in WORKER_COUNTERS:
            worker = name.split('worker_id="', 1)[1].split('"', 1)[0]
            out.setdefault(worker, {})[key.removesuffix("_total")] = float(value)
    return out
