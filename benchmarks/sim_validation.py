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

The real engine's run-to-run spread can be as wide as the target, so compare like with like
(recommended): `--repeats 3` runs each case's engine three times (a fresh server each) and
`--sim-samples 16` runs the simulator 16 times with the profile's measured step-time noise
and the runs' measured send lag; the headline is the simulated mean against the measured mean
(`sim_validation_report.py`). `--measured OLD.json[,...] --profile P.json` re-simulates the
measured runs of earlier outputs without running the engine. Defaults (1 run, 1 deterministic
simulation) are the single-run comparison.

Nothing is fitted to a trace: step times, per-step host overhead and the KV link come from
`deepinfer profile` (measured here before the runs); the shared store's speed is a stated
assumption (1 GB/s + 1 ms). The host's cores are shared (contention). For every real run the
script also records each process's CPU seconds (front, workers, this client) and the
cluster's counters, next to the simulator's busy time per worker, so a gap can be traced to
where the time went.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.sim_validation_calibration import (  # noqa: E402
    configure, format_host_cpu, simulated_host_cpu)
from benchmarks.sim_validation_cluster import (  # noqa: E402,F401 (re-exported)
    measured_link, memory_contention_key, sim_cluster, time_sharing_key, use_rules)
from benchmarks.sim_validation_engine import DEEPINFER, NUM_KV_BLOCKS, serve_and_bench  # noqa: E402
from benchmarks.sim_validation_report import (  # noqa: E402
    compare, format_first_gap, format_p50_position, format_repeat_rows, measured_first_gap,
    p50_position, repeat_rows, summary_from_dict)
from deepinfer.bench.latency_stats import finite_json  # noqa: E402
from deepinfer.bench.traces import ShrinkConfig  # noqa: E402
from deepinfer.bench.workload_args import add_workload_args, workload_config_from_args  # noqa: E402
from deepinfer.bench.workloads import WorkloadConfig, build_workload  # noqa: E402
from deepinfer.sim import simulate_workload  # noqa: E402
from deepinfer.sim.perturbation import NoiseSpec  # noqa: E402
from deepinfer.sim.sampling import sample_runs, samples_report  # noqa: E402
from deepinfer.sim.sim_report import first_decode_gap  # noqa: E402

# shared/traces beside the checkout (/work/main) or above it (a worktree under /work/wt)
TRACE = next((p / "shared" / "traces" for p in ROOT.parents if (p / "shared" / "traces").is_dir()),
             ROOT.parent / "shared" / "traces") / "mooncake" / "conversation_trace.jsonl"


def measure_profile(path: str, grid: str) -> None:
    subprocess.run(DEEPINFER + ["profile", "--grid", grid, "--threads", "1",
                                "--kv-cache-memory", "512MiB", "--host-sharing", "4",
                                "--time-sharing", "--memory-contention",
                                "--out", path], check=True)


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
            "simulated_cpu_s": getattr(sim_run.simulator, "cpu_time_s", {}).get(
                w.worker_id, w.work_time_s),
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


def sim_cpu(sim_run) -> dict[str, float]:
    """Simulated CPU seconds per worker: its work, / the time-sharing efficiency while its
    core was time-shared (= the work without `host.time_sharing`)."""
    cpu = sim_run.simulator.cpu_time_s
    return {w: cpu[w] for w in sim_run.simulator.workers}


def work_error(cpu_s: dict[str, float], sim_run, simulated: dict | None = None
               ) -> float | None:
    """Simulated work of all workers / their processes' measured CPU seconds - 1: the
    profile's (and host overhead's) error on this run's work, little moved by other load.
    `simulated`: another per-worker estimate instead of the work (e.g. `sim_cpu`)."""
    measured = sum(v for k, v in cpu_s.items() if k.startswith("child-"))
    simulated = sum((simulated if simulated is not None else sim_work(sim_run)).values())
    return simulated / measured - 1.0 if measured > 0 else None


# ---- arguments and cases ----------------------------------------------------------------------
def parse_args(argv: list[str] | None = None):
    """(args, the custom workload's config); bad input exits 2 with one line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default=None, help="use this profile instead of measuring")
    parser.add_argument("--calibration", default=None, metavar="MANIFEST",
                        help="a frozen calibration (sim_frozen_calibration.py): its profile, "
                             "host-CPU costs and simulator rules; nothing is measured")
    parser.add_argument("--grid", default="quick", choices=("quick", "full"))
    parser.add_argument("--w1-prompts", type=int, default=32)
    parser.add_argument("--mooncake-prompts", type=int, default=40)
    parser.add_argument("--cases", default=None,
                        help="comma list of w1, mooncake, mooncake-pd, workload, workload-pd "
                             "(default: workload,workload-pd with --trace/--workload, else "
                             "w1,mooncake,mooncake-pd)")
    parser.add_argument("--trace", default=None, metavar="PATH",
                        help="a trace bench serve reads (Mooncake / Bailian JSONL, Azure / BurstGPT "
                             "CSV, generic JSONL/CSV, gzip too; --trace-format to force one): "
                             "the workload cases replay it (= --workload trace:PATH)")
    parser.add_argument("--repeats", type=int, default=1, metavar="N",
                        help="real runs per case, a fresh server each (default 1)")
    parser.add_argument("--sim-samples", type=int, default=1, metavar="K",
                        help="perturbed simulations per case with the profile's measured "
                             "step-time CV and the runs' measured send lag (default 1: the "
                             "deterministic run only)")
    parser.add_argument("--step-time-cv", type=float, default=None,
                        help="the samples' step-time CV instead of the profile's")
    parser.add_argument("--measured", default=None, metavar="JSON[,JSON...]",
                        help="re-simulate only: each case's measured runs from these earlier "
                             "outputs of this script (no engine run; needs --profile)")
    parser.add_argument("--host-cpu", default=None, metavar="measure|off|PATH",
                        help="front / client CPU on the shared cores: measure (default with "
                             "engine runs; sim_validation_calibration.py), off (default with "
                             "--measured), or an earlier calibration JSON")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/sim_validation.json"))
    add_workload_args(parser)
    args = parser.parse_args(argv)
    if args.calibration is not None:
        from benchmarks.sim_frozen_files import load_frozen
        if args.profile is not None or args.host_cpu is not None:
            parser.exit(2, "sim_validation: --calibration brings its own profile and host CPU\n")
        try:
            frozen = load_frozen(args.calibration)
            use_rules(frozen.get("simulator", {}))
        except (OSError, ValueError, KeyError) as e:
            parser.exit(2, f"sim_validation: {e}\n")
        args.profile, args.host_cpu = frozen["profile_path"], frozen["host_cpu_path"]
        args.frozen = frozen
    if args.trace is not None:
        args.workload = f"trace:{args.trace}"
    custom = args.trace is not None or args.workload != "random"
    if args.cases is None:
        args.cases = "workload,workload-pd" if custom else "w1,mooncake,mooncake-pd"
    try:
        custom_workload = workload_config_from_args(args)
        if args.step_time_cv is not None:
            NoiseSpec(step_time_cv=args.step_time_cv)  # its range check
    except ValueError as e:
        parser.exit(2, f"sim_validation: {e}\n")
    unknown = set(args.cases.split(",")) - set(CASE_NAMES)
    if unknown:
        parser.exit(2, f"sim_validation: unknown cases {sorted(unknown)}\n")
    if args.repeats < 1 or args.sim_samples < 1:
        parser.exit(2, "sim_validation: --repeats and --sim-samples must be >= 1\n")
    if args.measured is not None and args.profile is None:
        parser.exit(2, "sim_validation: --measured needs --profile (the runs' profile)\n")
    return args, custom_workload


CASE_NAMES = ("w1", "mooncake", "mooncake-pd", "workload", "workload-pd")


def build_cases(args, custom_workload, store_dir: str) -> dict:
    """name -> (workload config, serve args for run i, simulated pools)."""
    w1 = WorkloadConfig(kind="random", num_prompts=args.w1_prompts, input_len=256,
                        output_len=128, request_rate=float("inf"))
    mooncake = WorkloadConfig(kind=f"trace:{TRACE}", num_prompts=args.mooncake_prompts,
                              time_scale=0.1,
                              shrink=ShrinkConfig(length_scale=0.05, max_input_len=768,
                                                  max_output_len=48))
    pd_pools = {"prefill": {"workers": 2}, "decode": {"workers": 2}}
    colocated = {"colocated": {"workers": 1}}

    def pd_args(name: str):  # every run of a P/D case starts with an empty store
        return lambda i: ["--prefill-workers", "2", "--decode-workers", "2",
                          "--kv-store", f"fs://{os.path.join(store_dir, f'{name}-{i}')}"]
    return {
        "w1": (w1, lambda i: [], colocated),
        "mooncake": (mooncake, lambda i: [], colocated),
        "mooncake-pd": (mooncake, pd_args("mooncake-pd"), pd_pools),
        "workload": (custom_workload, lambda i: [], colocated),
        "workload-pd": (custom_workload, pd_args("workload-pd"), pd_pools),
    }


# ---- measured runs ----------------------------------------------------------------------------
def measure_runs(name: str, workload, serve_args, repeats: int) -> list[dict]:
    runs = []
    for i in range(repeats):
        print(f"[{name}] real engine, run {i + 1}/{repeats}: {workload.description}",
              flush=True)
        runs.append(serve_and_bench(serve_args(i), workload))
    return runs


def loaded_runs(paths: list[str], name: str) -> list[dict]:
    """A case's measured runs from earlier outputs of this script (every run of a file that
    kept them all, else its one measured run), in the shape `serve_and_bench` returns."""
    runs = []
    for path in paths:
        with open(path) as f:
            case = json.load(f).get("cases", {}).get(name)
        if case is None:
            continue
        stored = case.get("measured_runs") or [{
            "summary": case["measured_summary"], "hit_rate": case.get("measured_hit_rate"),
            "load_average": case.get("load_average"), "cpu_s": case.get("measured_cpu_s"),
            "first_token_times_ms": case.get("measured_first_token_times_ms")}]
        for run in stored:
            runs.append({**run, "summary": summary_from_dict(run["summary"]), "source": path})
    return runs


def run_json(run: dict) -> dict:
    """What the JSON keeps of each measured run."""
    keep = ("hit_rate", "load_average", "cpu_s", "send_lag_ms", "first_token_times_ms",
            "ttfts_ms", "first_error", "source", "workers")
    return {"summary": dataclasses.asdict(run["summary"]),
            **{k: run.get(k) for k in keep if k in run}}


# ---- simulations ------------------------------------------------------------------------------
def sample_noise(args, runs: list[dict]) -> NoiseSpec:
    """The samples' noise: the profile's measured step-time CV (or --step-time-cv) and the
    measured runs' mean send lag (the default when no run recorded it)."""
    lags = [r["send_lag_ms"] for r in runs if r.get("send_lag_ms") is not None]
    return NoiseSpec(step_time_cv=args.step_time_cv,
                     arrival_jitter_ms=sum(lags) / len(lags) if lags else None)


def simulate_case(profile: str, pools: dict, workload, noise: NoiseSpec, num_samples: int):
    """(the deterministic run, the samples' runs: none when `num_samples` is 1)."""
    sim_run = simulate_workload(sim_cluster(profile, pools), workload)
    if num_samples < 2:
        return sim_run, []
    return sim_run, sample_runs(sim_cluster(profile, pools, noise=noise), workload, num_samples)


def sim_ttfts_ms(sim_run) -> list[float]:
    return [1e3 * r.ttft_s for r in sim_run.results if r.ttft_s is not None]


def measured_p50_position(run: dict) -> dict | None:
    if run.get("ttfts_ms"):
        return p50_position(run["ttfts_ms"])
    return p50_position(run.get("first_token_times_ms") or [], of="first_token_time")


def case_report(name: str, workload, runs: list[dict], sim_run, samples: list, profile: str,
                pools: dict) -> dict:
    """The case's JSON: the comparison over all runs and samples, then the first run in
    detail under the keys earlier outputs had."""
    real, sim = runs[0], sim_run.summary()
    summaries = [r["summary"] for r in runs]
    sample_summaries = [s.summary() for s in samples]
    case = {
        "workload": workload.description, "num_measured_runs": len(runs),
        "num_sim_samples": len(samples),
        "comparison": repeat_rows(summaries, sim, sample_summaries or None),
        "simulated_samples": samples_report(samples) if samples else None,
        "measured_runs": [run_json(r) for r in runs],
        "ttft_p50_position": {
            "measured": [measured_p50_position(r) for r in runs],
            "simulated": p50_position(sim_ttfts_ms(sim_run))},
        "errors": compare(real["summary"], sim),
        "errors_per_run": [compare(s, sim) for s in summaries],
        "measured_summary": dataclasses.asdict(real["summary"]),
        "simulated_summary": dataclasses.asdict(sim),
        "measured_hit_rate": real.get("hit_rate"),
        "simulated_hit_rate": sim_run.prefix_cache_hit_rate,
        "load_average": real.get("load_average"), "measured_cpu_s": real.get("cpu_s"),
        "cluster_counters": real.get("cluster_counters"),
        "simulated_busy_s": sim_busy(sim_run), "simulated_work_s": sim_work(sim_run),
        "simulated_host_cpu_s": simulated_host_cpu(sim_run),
        "work_error": work_error(real["cpu_s"], sim_run) if real.get("cpu_s") else None,
        "simulated_cpu_s": sim_cpu(sim_run),
        "cpu_error": (work_error(real["cpu_s"], sim_run, sim_cpu(sim_run))
                      if real.get("cpu_s") else None),
        "time_sharing": (dataclasses.asdict(sim_run.simulator.time_sharing)
                         if sim_run.simulator.time_sharing is not None else None),
        "memory_contention": (dataclasses.asdict(sim_run.simulator.memory_contention)
                              if sim_run.simulator.memory_contention is not None else None),
        "workers": worker_breakdown(real.get("workers") or {}, sim_run),
        "first_decode_gap": {
            "measured": [measured_first_gap(r.get("workers") or {}) for r in runs],
            "simulated": first_decode_gap(sim_run.records)},
        "simulated_work_cpu_clock_s": None, "work_error_cpu_clock": None,
        "errors_at_start_sharing": compare(real["summary"], simulate_workload(
            sim_cluster(profile, pools, "at-start"), workload).summary()),
        "errors_measured_sharing": measured_sharing_errors(real["summary"], profile, pools,
                                                           workload),
        "measured_first_token_times_ms": real.get("first_token_times_ms"),
        "simulated_first_token_times_ms": sorted(
            1e3 * r.token_times_s[0] for r in sim_run.records if r.token_times_s),
        "measured_failed": real["summary"].num_failed,
        "measured_first_error": real.get("first_error"), "simulated_failed": sim.num_failed}
    return case


def add_cpu_clock(case: dict, cpu_profile: str | None, pools: dict, workload,
                  real: dict) -> None:
    """The same case simulated with the profile refitted on CPU seconds (work check)."""
    if cpu_profile is None:
        return
    cpu_run = simulate_workload(sim_cluster(cpu_profile, pools), workload)
    case["simulated_work_cpu_clock_s"] = sim_work(cpu_run)
    case["work_error_cpu_clock"] = (work_error(real["cpu_s"], cpu_run)
                                    if real.get("cpu_s") else None)
    case["errors_cpu_clock_profile"] = compare(real["summary"], cpu_run.summary())


# ---- printing ---------------------------------------------------------------------------------
def print_case(name: str, case: dict) -> None:
    """The like-with-like comparison, then where each TTFT p50 sits, then the first run's
    details (sharing models, CPU seconds, per-worker split)."""
    n, k = case["num_measured_runs"], case["num_sim_samples"]
    print(f"[{name}] {n} measured run(s) vs the simulator ("
          f"{f'{k} perturbed samples' if k else 'deterministic'}); * = the headline metrics",
          flush=True)
    print(format_repeat_rows(case["comparison"]), flush=True)
    samples = case["simulated_samples"]
    if samples:
        cvs = ", ".join(f"{r} {cv:.3f}" for r, cv in samples["step_time_cv"].items())
        print(f"  samples' noise: step-time CV {cvs}; send lag "
              f"{samples['arrival_jitter_ms']:.2f} ms", flush=True)
    for i, pos in enumerate(case["ttft_p50_position"]["measured"]):
        print(format_p50_position(f"measured run {i + 1}", pos), flush=True)
    print(format_p50_position("simulated", case["ttft_p50_position"]["simulated"]), flush=True)
    failed = case["measured_failed"]
    if failed:
        print(f"  measured: {failed} requests failed in the first run "
              f"({case['measured_first_error']}); its errors compare unequal runs", flush=True)
    print_first_run_details(case)


def _errors_line(rows: dict) -> str:
    return ", ".join(f"{k} {100 * r['error']:+.1f}%" for k, r in rows.items()
                     if r["error"] is not None)


def print_first_run_details(case: dict) -> None:
    print("  first run, with at-start host sharing: " + _errors_line(
        case["errors_at_start_sharing"]), flush=True)
    if case["errors_measured_sharing"]:
        print("  first run, with measured host sharing: " + _errors_line(
            case["errors_measured_sharing"]), flush=True)
    if case["measured_cpu_s"]:
        print("  measured CPU s: " + ", ".join(f"{k} {v:.1f}" for k, v in
                                               sorted(case["measured_cpu_s"].items())),
              flush=True)
    print("  simulated busy s: " + ", ".join(
        f"{k} {v:.1f}" for k, v in case["simulated_busy_s"].items()) +
        "; work at full speed (CPU s): " + ", ".join(
        f"{k} {v:.1f}" for k, v in case["simulated_work_s"].items()), flush=True)
    if format_host_cpu(case.get("simulated_host_cpu_s")):
        print(format_host_cpu(case["simulated_host_cpu_s"]), flush=True)
    for worker_id, row in case["workers"].items():
        print_worker(worker_id, row)
    gap = case.get("first_decode_gap") or {}
    line = format_first_gap((gap.get("measured") or [None])[0], gap.get("simulated"))
    if line:
        print(line, flush=True)
    if case["work_error"] is not None:
        print(f"  simulated work vs the workers' measured CPU seconds: "
              f"{100 * case['work_error']:+.1f}%", flush=True)
    if (case.get("time_sharing") or case.get("memory_contention")) \
            and case.get("cpu_error") is not None:
        print(f"  simulated CPU (work / time-sharing and memory-contention efficiency) vs the "
              f"same: {100 * case['cpu_error']:+.1f}% (" + ", ".join(
                  f"{k} {v:.1f}" for k, v in case["simulated_cpu_s"].items()) + ")",
              flush=True)
    if case["work_error_cpu_clock"] is not None:
        print(f"  ... with the profile refitted on CPU seconds: "
              f"{100 * case['work_error_cpu_clock']:+.1f}% (" + ", ".join(
                  f"{k} {v:.1f}" for k, v in case["simulated_work_cpu_clock_s"].items()) + ")",
              flush=True)


def print_worker(worker_id: str, row: dict) -> None:
    m = row["measured"]
    print(f"  {worker_id}: measured {m.get('engine_steps', 0):.0f} steps, model "
          f"{m.get('model_step_seconds', 0):.2f} s, loop {m.get('loop_step_seconds', 0):.2f} s "
          f"(host {row['measured_host_ms_per_step'] or 0:.2f} ms/step), CPU "
          f"{m.get('process_cpu_seconds', 0):.2f} s; simulated {row['simulated_steps']} steps, "
          f"work {row['simulated_work_s']:.2f} s"
          + (f", CPU {row['simulated_cpu_s']:.2f} s"
             if row.get("simulated_cpu_s", row["simulated_work_s"]) != row["simulated_work_s"]
             else ""), flush=True)
    if "model_step_cpu_seconds" in m:  # where the wall time outside CPU went
        print(f"    measured: CPU in steps {m['model_step_cpu_seconds']:.2f} s (steps' wall - "
              f"CPU {m.get('model_step_seconds', 0) - m['model_step_cpu_seconds']:.2f} s), "
              f"idle waiting for input {m.get('idle_wait_seconds', 0):.2f} s", flush=True)
    if row["simulated_prefilled_requests"] or m.get("prefilled_requests"):
        print(f"    prefilled requests: measured {m.get('prefilled_requests', 0):.0f}, "
              f"simulated {row['simulated_prefilled_requests']}; computed tokens: measured "
              f"{m.get('prefill_computed_tokens', 0):.0f}, simulated "
              f"{row['simulated_prefill_computed_tokens']}", flush=True)


# ---- main -------------------------------------------------------------------------------------
def run_case(name: str, case_def, args, profile: str, cpu_profile: str | None) -> dict:
    cfg, serve_args, pools = case_def
    workload = build_workload(cfg)
    if args.measured is not None:
        runs = loaded_runs(args.measured.split(","), name)
        if not runs:
            raise SystemExit(f"sim_validation: no measured {name} runs in {args.measured}")
    else:
        runs = measure_runs(name, workload, serve_args, args.repeats)
    sim_run, samples = simulate_case(profile, pools, workload, sample_noise(args, runs),
                                     args.sim_samples)
    case = case_report(name, workload, runs, sim_run, samples, profile, pools)
    add_cpu_clock(case, cpu_profile, pools, workload, runs[0])
    case["measured_summaries_obj"] = [r["summary"] for r in runs]
    print_case(name, case)
    return case


def resimulate_after(report: dict, cases: dict, profile_after: str) -> None:
    """Every case again with the profile measured after the runs (the box's drift)."""
    report["profile_after"] = profile_after
    for name, case in report["cases"].items():
        cfg, _, pools = cases[name]
        sim = simulate_workload(sim_cluster(profile_after, pools),
                                build_workload(cfg)).summary()
        measured = case["measured_summaries_obj"]
        case["errors_with_profile_after"] = compare(measured[0], sim)
        case["comparison_with_profile_after"] = repeat_rows(measured, sim)
        print(f"[{name}] with the after-run profile (first run): "
              + _errors_line(case["errors_with_profile_after"]) + "; of the measured mean: "
              + ", ".join(f"{k} {100 * r['error_of_mean']:+.1f}%" for k, r in
                          case["comparison_with_profile_after"].items()
                          if r["error_of_mean"] is not None), flush=True)


def main(argv: list[str] | None = None) -> None:
    args, custom_workload = parse_args(argv)
    stem = Path(args.out).stem
    profile = args.profile or str(Path(args.out).with_name(f"{stem}_profile.json"))
    if args.profile is None:
        print(f"measuring a {args.grid} profile (1 thread) ...", flush=True)
        measure_profile(profile, args.grid)
    with open(profile) as f:
        meta = json.load(f).get("metadata", {})
    host_cpu = configure(args.host_cpu, resimulate_only=args.measured is not None)
    if getattr(args, "frozen", None) is not None:  # with the frozen calibration's derived terms
        from benchmarks.sim_frozen_files import host_cpu_with_derived
        from benchmarks.sim_validation_calibration import use_calibration
        host_cpu = host_cpu_with_derived(args.frozen)
        use_calibration(host_cpu)
    cpu_profile = cpu_clock_profile(profile)
    report = {"profile": profile, "cpu_clock_profile": cpu_profile, "grid": args.grid,
              "num_kv_blocks": NUM_KV_BLOCKS, "cpu_count": os.cpu_count(),
              "host_overhead": meta.get("host_overhead"), "kv_link": measured_link(profile),
              "step_time_cv": meta.get("step_time_cv"), "repeats": args.repeats,
              "sim_samples": args.sim_samples, "measured_from": args.measured,
              "host_cpu": host_cpu, "cases": {}}
    store_dir = tempfile.mkdtemp(prefix="sim-validation-store-")
    cases = build_cases(args, custom_workload, store_dir)
    try:
        for name in args.cases.split(","):
            report["cases"][name] = run_case(name, cases[name], args, profile, cpu_profile)
            write(args.out, report)
        if args.profile is None:
            # The box is shared: re-profile after the runs and simulate again, so the report
            # shows how much of the error is the machine's speed drifting under us.
            print("re-measuring the profile after the runs ...", flush=True)
            profile_after = str(Path(args.out).with_name(f"{stem}_profile_after.json"))
            measure_profile(profile_after, args.grid)
            resimulate_after(report, cases, profile_after)
            write(args.out, report)
    finally:
        shutil.rmtree(store_dir, ignore_errors=True)
    print(f"wrote {args.out}")


def write(path: str, report: dict) -> None:
    clean = {k: v for k, v in report.items() if k != "cases"}
    clean["cases"] = {name: {k: v for k, v in case.items() if not k.endswith("_obj")}
                      for name, case in report["cases"].items()}
    with open(path, "w") as f:
        json.dump(finite_json(clean), f, indent=1, default=lambda x: None)


if __name__ == "__main__":
    main()
