"""Simulator vs the real engine on this machine: same workloads, a cost profile measured here.

For each case the real `deepinfer serve` (one thread per engine process) is loaded with the
`bench serve` client, then the simulator runs the same workload on the same cluster shape with
step times from a quick profile measured at the start of this script (same threads). Prints
and writes the relative errors of TTFT p50, TPOT p50 and output throughput:

  w1        random 256 in / 128 out, all at once, one colocated engine
  mooncake  the Mooncake conversation trace shrunk in length and time, one colocated engine
  mooncake-pd  the same replay on P=2 prefill + D=2 decode workers (fs shared store)
  workload     any `bench serve` workload (--trace PATH or --workload, with its shrinking
               flags), one colocated engine
  workload-pd  the same on P=2 / D=2

    .venv/bin/python benchmarks/sim_validation.py --out benchmarks/results/sim_validation.json
    .venv/bin/python benchmarks/sim_validation.py --trace T.csv --num-prompts 40 \
        --length-scale 0.25 --max-input-len 768 --max-output-len 48 --time-scale 0.1

Nothing is fitted to a trace: step times, per-step host overhead and the KV link come from
`deepinfer profile` (measured here before the runs); the shared store's speed is a stated
assumption (1 GB/s + 1 ms). The host's cores are shared (contention). For every real run the
script also records each process's CPU seconds (front, workers, this client) and the
cluster's counters, next to the simulator's busy time per worker, so a gap can be traced to
where the time went.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deepinfer.bench.latency_stats import summarize  # noqa: E402
from deepinfer.bench.serve_client import ClientConfig, run_benchmark  # noqa: E402
from deepinfer.bench.traces import ShrinkConfig  # noqa: E402
from deepinfer.bench.workload_args import add_workload_args, workload_config_from_args  # noqa: E402
from deepinfer.bench.workloads import WorkloadConfig, build_workload  # noqa: E402
from deepinfer.sim import cluster_from_dict, simulate_workload  # noqa: E402

TRACE = ROOT.parent / "shared" / "traces" / "mooncake" / "conversation_trace.jsonl"
DEEPINFER = [str(Path(sys.executable).with_name("deepinfer"))]
NUM_KV_BLOCKS = 2048
METRICS = (("ttft_ms", "p50"), ("tpot_ms", "p50"), ("output_throughput", None),
           ("ttft_ms", "mean"))  # the mean: not on a step boundary as p50 can be (docs)


def measure_profile(path: str, grid: str) -> None:
    subprocess.run(DEEPINFER + ["profile", "--grid", grid, "--threads", "1",
                                "--kv-cache-memory", "512MiB", "--host-sharing", "4",
                                "--out", path], check=True)


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_and_bench(extra_args: list[str], workload) -> dict:
    """Start `deepinfer serve`, replay the workload with the bench client, stop the server."""
    import httpx
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="sim-validation-serve-", suffix=".log")
    proc = subprocess.Popen(DEEPINFER + ["serve", "--port", str(port), "--threads", "1",
                                         "--num-kv-blocks", str(NUM_KV_BLOCKS), *extra_args],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"serve exited: {log.read()[-2000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("serve not ready")
            time.sleep(0.5)
        config = ClientConfig(base_url=f"http://127.0.0.1:{port}", show_progress=False)
        # Warm-up (not measured): the first steps of a fresh engine pay one-off costs
        # (allocator growth, kernel selection) that the profile, measured warm, excludes.
        warm = build_workload(WorkloadConfig(kind="random", num_prompts=4, input_len=256,
                                             output_len=16, seed=12345))
        asyncio.run(run_benchmark(config, warm.requests))
        load_before = os.getloadavg()[0]
        cpu_before = process_cpu_seconds(proc.pid)
        workers_before = worker_counters(port)
        run = asyncio.run(run_benchmark(config, workload.requests))
        cpu_after = process_cpu_seconds(proc.pid)
        workers_after = worker_counters(port)
        summary = summarize(run.results, run.duration_s)
        cpu = {name: cpu_after[name] - cpu_before.get(name, 0.0) for name in cpu_after}
        return {"summary": summary, "hit_rate": run.prefix_cache_hit_rate,
                "load_before": load_before, "load_after": os.getloadavg()[0],
                "cpu_s": cpu, "cluster_counters": cluster_counters(port),
                "workers": {w: {k: v - workers_before.get(w, {}).get(k, 0.0)
                                for k, v in c.items()} for w, c in workers_after.items()},
                "first_error": next((r.error for r in run.results if not r.success), None),
                # Per request (sorted): shows which step each first token came out of.
                "ttfts_ms": sorted(1e3 * (r.start_s + r.ttft_s) for r in run.results
                                   if r.ttft_s is not None)}
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


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
                   "prefill_computed_tokens_total")


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


def worker_breakdown(measured: dict, sim_run) -> dict:
    """Per P/D worker: measured steps / model seconds / loop seconds / CPU seconds next to the
    simulator's steps and work, and the measured host work per step (loop - model)."""
    out = {}
    records = sim_run.simulator.requests.values()
    for w in sim_run.simulator.workers.values():
        m = measured.get(w.worker_id)
        if not m:
            continue
        steps = m.get("engine_steps", 0.0)
        mine = [r for r in records if r.prefill_worker == w.worker_id]
        out[w.worker_id] = {
            "measured": m, "simulated_steps": w.num_steps, "simulated_work_s": w.work_time_s,
            "simulated_prefilled_requests": len(mine),
            "simulated_prefill_computed_tokens": sum(
                r.prompt_len - (r.num_cached_tokens or 0) for r in mine),
            "measured_host_ms_per_step": (1e3 * (m.get("loop_step_seconds", 0.0)
                                                 - m.get("model_step_seconds", 0.0)) / steps
                                          if steps else None),
            "cpu_vs_simulated_work": (m.get("process_cpu_seconds", 0.0) / w.work_time_s - 1.0
                                      if w.work_time_s else None)}
    return out


def cpu_clock_profile(profile: str) -> str | None:
    """The profile refitted on its steps' CPU seconds, written beside it (None: the profile
    has no CPU times). On a loaded box its simulated work is the fairer match for the
    workers' measured CPU seconds than the wall-time profile's."""
    from deepinfer.sim.step_time import load_cost_profile, refit_on_cpu_time
    try:
        model = refit_on_cpu_time(load_cost_profile(profile))
    except ValueError:
        return None
    path = str(Path(profile).with_name(Path(profile).stem + "_cpu.json"))
    with open(path, "w") as f:
        json.dump(model.to_dict(), f, indent=1)
    return path


def measured_link(profile: str) -> dict:
    """The KV transport `deepinfer profile` measured on this host (stage copy + pull +
    write), or the old stated assumption when the profile has none."""
    with open(profile) as f:
        link = json.load(f).get("metadata", {}).get("kv_transport")
    if not link:
        return {"bandwidth_gb_s": 1.0, "latency_ms": 2.0}
    return {"bandwidth_gb_s": link["bandwidth_gb_s"], "latency_ms": link["latency_ms"]}


def sim_cluster(profile: str, pools: dict, sharing: str = "fair") -> object:
    return cluster_from_dict({
        "cost": {"profile": profile},
        "engine": {"num_kv_blocks": NUM_KV_BLOCKS, "threads": 1},
        "pools": pools, "host": {"cores": os.cpu_count(), "sharing": sharing},
        "kv_transfer": measured_link(profile),
        "prefix_store": {"bandwidth_gb_s": 1.0, "latency_ms": 1.0}})


def measured_sharing_errors(measured, profile: str, pools: dict, workload) -> dict | None:
    """Errors with the host-sharing speeds the profile measured (None if it has none)."""
    try:
        cluster = sim_cluster(profile, pools, "measured")
        return compare(measured, simulate_workload(cluster, workload).summary())
    except ValueError:
        return None


def sim_busy(sim_run) -> dict[str, float]:
    """Simulated seconds each worker spent in steps (incl. host overhead and contention)."""
    return {w.worker_id: w.busy_time_s for w in sim_run.simulator.workers.values()}


def sim_work(sim_run) -> dict[str, float]:
    """Simulated work per worker at full speed: what its process's CPU seconds should be
    (one thread), however loaded the box was; compare with the measured CPU seconds."""
    return {w.worker_id: w.work_time_s for w in sim_run.simulator.workers.values()}


def work_error(cpu_s: dict[str, float], sim_run) -> float | None:
    """Simulated work of all workers / their processes' measured CPU seconds - 1: the
    profile's (and host overhead's) error on this run's work, little moved by other load."""
    measured = sum(v for k, v in cpu_s.items() if k.startswith("child-"))
    simulated = sum(sim_work(sim_run).values())
    return simulated / measured - 1.0 if measured > 0 else None


def metric(summary, key, sub):
    value = getattr(summary, key)
    return getattr(value, sub) if sub else value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default=None, help="use this profile instead of measuring")
    parser.add_argument("--grid", default="quick", choices=("quick", "full"))
    parser.add_argument("--w1-prompts", type=int, default=32)
    parser.add_argument("--mooncake-prompts", type=int, default=40)
    parser.add_argument("--cases", default=None,
                        help="comma list of w1, mooncake, mooncake-pd, workload, workload-pd "
                             "(default: workload,workload-pd with --trace/--workload, else "
                             "w1,mooncake,mooncake-pd)")
    parser.add_argument("--trace", default=None, metavar="PATH",
                        help="a trace bench serve reads (.jsonl Mooncake, .csv Azure): the "
                             "workload cases replay it (= --workload trace:PATH)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/sim_validation.json"))
    add_workload_args(parser)
    args = parser.parse_args()
    if args.trace is not None:
        args.workload = f"trace:{args.trace}"
    custom = args.trace is not None or args.workload != "random"
    if args.cases is None:
        args.cases = "workload,workload-pd" if custom else "w1,mooncake,mooncake-pd"
    try:
        custom_workload = workload_config_from_args(args)
    except ValueError as e:
        parser.exit(2, f"sim_validation: {e}\n")
    unknown = set(args.cases.split(",")) - {"w1", "mooncake", "mooncake-pd", "workload",
                                            "workload-pd"}
    if unknown:
        parser.exit(2, f"sim_validation: unknown cases {sorted(unknown)}\n")

    stem = Path(args.out).stem
    profile = args.profile or str(Path(args.out).with_name(f"{stem}_profile.json"))
    profile_after = str(Path(args.out).with_name(f"{stem}_profile_after.json"))
    if args.profile is None:
        print(f"measuring a {args.grid} profile (1 thread) ...", flush=True)
        measure_profile(profile, args.grid)
    w1 = WorkloadConfig(kind="random", num_prompts=args.w1_prompts, input_len=256,
                        output_len=128, request_rate=float("inf"))
    mooncake = WorkloadConfig(kind=f"trace:{TRACE}", num_prompts=args.mooncake_prompts,
                              time_scale=0.1,
                              shrink=ShrinkConfig(length_scale=0.05, max_input_len=768,
                                                  max_output_len=48))
    store_dir = tempfile.mkdtemp(prefix="sim-validation-store-")
    pd_pools = {"prefill": {"workers": 2}, "decode": {"workers": 2}}

    def pd_args(name: str) -> list[str]:  # each P/D case starts with an empty store
        return ["--prefill-workers", "2", "--decode-workers", "2",
                "--kv-store", f"fs://{os.path.join(store_dir, name)}"]
    cases = {
        "w1": (w1, [], {"colocated": {"workers": 1}}),
        "mooncake": (mooncake, [], {"colocated": {"workers": 1}}),
        "mooncake-pd": (mooncake, pd_args("mooncake-pd"), pd_pools),
        "workload": (custom_workload, [], {"colocated": {"workers": 1}}),
        "workload-pd": (custom_workload, pd_args("workload-pd"), pd_pools),
    }
    with open(profile) as f:
        meta = json.load(f).get("metadata", {})
    cpu_profile = cpu_clock_profile(profile)
    report = {"profile": profile, "cpu_clock_profile": cpu_profile, "grid": args.grid,
              "num_kv_blocks": NUM_KV_BLOCKS,
              "cpu_count": os.cpu_count(), "host_overhead": meta.get("host_overhead"),
              "kv_link": measured_link(profile), "cases": {}}
    try:
        for name in args.cases.split(","):
            cfg, serve_args, pools = cases[name]
            workload = build_workload(cfg)
            print(f"[{name}] real engine: {workload.description}", flush=True)
            real = serve_and_bench(serve_args, workload)
            sim_run = simulate_workload(sim_cluster(profile, pools), workload)
            sim = sim_run.summary()
            rows = compare(real["summary"], sim)
            report["cases"][name] = {
                "workload": workload.description, "errors": rows,
                "measured_summary": dataclasses.asdict(real["summary"]),
                "simulated_summary": dataclasses.asdict(sim),
                "measured_hit_rate": real["hit_rate"], "simulated_hit_rate":
                    sim_run.prefix_cache_hit_rate, "load_average": [real["load_before"],
                                                                    real["load_after"]],
                "measured_cpu_s": real["cpu_s"], "cluster_counters": real["cluster_counters"],
                "simulated_busy_s": sim_busy(sim_run), "simulated_work_s": sim_work(sim_run),
                "work_error": work_error(real["cpu_s"], sim_run),
                "workers": worker_breakdown(real["workers"], sim_run),
                "simulated_work_cpu_clock_s": None, "work_error_cpu_clock": None,
                "errors_at_start_sharing": compare(real["summary"], simulate_workload(
                    sim_cluster(profile, pools, "at-start"), workload).summary()),
                "errors_measured_sharing": measured_sharing_errors(real["summary"], profile,
                                                                   pools, workload),
                "measured_summary_obj": real["summary"],
                "measured_first_token_times_ms": real["ttfts_ms"],
                "simulated_first_token_times_ms": sorted(
                    1e3 * r.token_times_s[0] for r in sim_run.records if r.token_times_s),
                "measured_failed": real["summary"].num_failed,
                "measured_first_error": real["first_error"],
                "simulated_failed": sim.num_failed}
            for metric_name, row in rows.items():
                print(f"  {metric_name:<22} measured {row['measured']:10.2f}  simulated "
                      f"{row['simulated']:10.2f}  error {100 * row['error']:+6.1f}%", flush=True)
            failed = real["summary"].num_failed
            if failed:
                print(f"  measured: {failed} of {real['summary'].num_requests} requests failed "
                      f"({real['first_error']}); the errors above compare unequal runs",
                      flush=True)
            print("  with at-start host sharing: " + ", ".join(
                f"{k} {100 * r['error']:+.1f}%" for k, r in
                report["cases"][name]["errors_at_start_sharing"].items()), flush=True)
            if report["cases"][name]["errors_measured_sharing"]:
                print("  with measured host sharing: " + ", ".join(
                    f"{k} {100 * r['error']:+.1f}%" for k, r in
                    report["cases"][name]["errors_measured_sharing"].items()), flush=True)
            print("  measured CPU s: " + ", ".join(f"{k} {v:.1f}" for k, v in
                                                   sorted(real["cpu_s"].items())) +
                  f" (duration {real['summary'].duration_s:.1f} s)", flush=True)
            print("  simulated busy s: " + ", ".join(f"{k} {v:.1f}" for k, v in
                                                     sim_busy(sim_run).items()) +
                  f" (duration {sim.duration_s:.1f} s); work at full speed (CPU s): " +
                  ", ".join(f"{k} {v:.1f}" for k, v in sim_work(sim_run).items()),
                  flush=True)
            for worker_id, row in report["cases"][name]["workers"].items():
                m = row["measured"]
                print(f"  {worker_id}: measured {m.get('engine_steps', 0):.0f} steps, model "
                      f"{m.get('model_step_seconds', 0):.2f} s, loop "
                      f"{m.get('loop_step_seconds', 0):.2f} s (host "
                      f"{row['measured_host_ms_per_step'] or 0:.2f} ms/step), CPU "
                      f"{m.get('process_cpu_seconds', 0):.2f} s; simulated "
                      f"{row['simulated_steps']} steps, work {row['simulated_work_s']:.2f} s",
                      flush=True)
                if "model_step_cpu_seconds" in m:  # where the wall time outside CPU went
                    print(f"    measured: CPU in steps {m['model_step_cpu_seconds']:.2f} s "
                          f"(steps' wall - CPU {m.get('model_step_seconds', 0) - m['model_step_cpu_seconds']:.2f} s), "
                          f"idle waiting for input {m.get('idle_wait_seconds', 0):.2f} s", flush=True)
                if row["simulated_prefilled_requests"] or m.get("prefilled_requests"):
                    print(f"    prefilled requests: measured {m.get('prefilled_requests', 0):.0f}, "
                          f"simulated {row['simulated_prefilled_requests']}; computed tokens: "
                          f"measured {m.get('prefill_computed_tokens', 0):.0f}, simulated "
                          f"{row['simulated_prefill_computed_tokens']}", flush=True)
            werr = report["cases"][name]["work_error"]
            if werr is not None:
                print(f"  simulated work vs the workers' measured CPU seconds: "
                      f"{100 * werr:+.1f}%", flush=True)
            if cpu_profile is not None:
                cpu_run = simulate_workload(sim_cluster(cpu_profile, pools), workload)
                case = report["cases"][name]
                case["simulated_work_cpu_clock_s"] = sim_work(cpu_run)
                case["work_error_cpu_clock"] = work_error(real["cpu_s"], cpu_run)
                case["errors_cpu_clock_profile"] = compare(real["summary"], cpu_run.summary())
                if case["work_error_cpu_clock"] is not None:
                    print(f"  ... with the profile refitted on CPU seconds: "
                          f"{100 * case['work_error_cpu_clock']:+.1f}% (" + ", ".join(
                              f"{k} {v:.1f}" for k, v in sim_work(cpu_run).items()) + ")",
                          flush=True)
            write(args.out, report)
        if args.profile is None:
            # The box is shared: re-profile after the runs and simulate again, so the report
            # shows how much of the error is the machine's speed drifting under us.
            print("re-measuring the profile after the runs ...", flush=True)
            measure_profile(profile_after, args.grid)
            report["profile_after"] = profile_after
            for name in report["cases"]:
                cfg, _, pools = cases[name]
                sim = simulate_workload(sim_cluster(profile_after, pools),
                                        build_workload(cfg)).summary()
                measured = report["cases"][name]["measured_summary_obj"]
                rows = compare(measured, sim)
                report["cases"][name]["errors_with_profile_after"] = rows
                print(f"[{name}] with the after-run profile: " + ", ".join(
                    f"{k} {100 * r['error']:+.1f}%" for k, r in rows.items()), flush=True)
            write(args.out, report)
    finally:
        shutil.rmtree(store_dir, ignore_errors=True)
    print(f"wrote {args.out}")


def compare(measured, simulated) -> dict:
    rows = {}
    for key, sub in METRICS:
        m, s = metric(measured, key, sub), metric(simulated, key, sub)
        rows[f"{key}{'_' + sub if sub else ''}"] = {
            "measured": m, "simulated": s, "error": s / m - 1.0 if m else None}
    return rows


def write(path: str, report: dict) -> None:
    clean = {k: v for k, v in report.items() if k != "cases"}
    clean["cases"] = {name: {k: v for k, v in case.items() if not k.endswith("_obj")}
                      for name, case in report["cases"].items()}
    with open(path, "w") as f:
        json.dump(clean, f, indent=1, default=lambda x: None)


if __name__ == "__main__":
    main()
