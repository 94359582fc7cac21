"""CPU the front door and the bench client take per request and per token, measured on this host.

The simulator's workers share the host's cores with the front door (`deepinfer serve`'s main
process) and the load generator, and (P/D) with the KV transport's threads (`sim.host_load`).
Their costs are measured here on a fixed calibration workload, never on the trace being
validated: random prompts of 256 tokens with 8 and then 64 output tokens (32 requests each,
8 req/s), on a colocated engine and on P=2 / D=2 (one server each, after a warm-up). Per
process and cluster shape, CPU = per_request · requests + per_token · tokens on the two runs
gives both costs; each shape has its own (a P/D front streams at a higher CPU cost per token
than a colocated one, and so does the client). A P/D front's per-request cost beyond the
colocated one's is its handoff (prefill done -> decode), charged when the handoff happens.
The KV transport's CPU per GB comes from the profile (`deepinfer profile`).

    .venv/bin/python benchmarks/sim_validation_calibration.py --out /tmp/host_cpu.json

`sim_validation.py` runs `calibrate` once before its cases (or loads `--host-cpu PATH`) and
its simulated clusters take `host_cpu_keys(profile)` into their `host` section.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OUTPUT_LENS = (8, 64)
NUM_REQUESTS, INPUT_LEN, RATE = 32, 256, 8.0

# The calibration in use by `host_cpu_keys` (None: front and client not modelled).
_calibration: dict | None = None
_enabled = True


def use_calibration(calibration: dict | None, enabled: bool = True) -> None:
    """What `host_cpu_keys` adds from now on: this calibration's front and client costs, and
    (when `enabled`) the profile's KV-transfer CPU; `enabled=False`: nothing at all."""
    global _calibration, _enabled
    _calibration, _enabled = calibration, enabled


def host_cpu_keys(profile: str, pools: dict) -> dict:
    """Keys for a simulated cluster's `host` section: the calibration's front / client costs
    for its shape (colocated or P/D) and the profile's KV transport CPU per GB (each only when
    measured)."""
    if not _enabled:
        return {}
    keys = {}
    if _calibration is not None:
        shape = _calibration["pd" if "prefill" in pools else "colocated"]
        keys["front_cpu"] = dict(shape["front_cpu"])
        keys["client_cpu"] = dict(shape["client_cpu"])
        if "prefill_cpu" in shape:
            keys["prefill_cpu"] = dict(shape["prefill_cpu"])
    with open(profile) as f:
        link = json.load(f).get("metadata", {}).get("kv_transport") or {}
    if link.get("cpu_s_per_gb"):
        keys["kv_transfer_cpu_s_per_gb"] = dict(link["cpu_s_per_gb"])
    return keys


def simulated_host_cpu(sim_run) -> dict | None:
    """CPU seconds the simulated front, client and KV-transfer ends were given (None: the
    cluster modelled none): set beside the measured front / client CPU seconds."""
    host_load = sim_run.simulator.host_load
    if host_load is None:
        return None
    work = host_load.work_s()
    return {"front": work.get("front", 0.0), "client": work.get("client", 0.0),
            "kv_transfers": sum(v for k, v in work.items() if k.startswith("kv-"))}


def format_host_cpu(simulated: dict | None) -> str | None:
    if simulated is None:
        return None
    return "  simulated other CPU s: " + ", ".join(f"{k} {v:.2f}" for k, v in simulated.items())


def _fit_two(points: list[tuple[int, int, float]]) -> tuple[float, float]:
    """(per_request, per_token) through two runs' (requests, tokens, CPU s), clipped at 0."""
    (r1, t1, c1), (r2, t2, c2) = points
    per_token = max(0.0, (c2 / r2 - c1 / r1) / (t2 / r2 - t1 / r1))
    per_request = max(0.0, sum(c - per_token * t for _, t, c in points)
                      / sum(r for r, _, _ in points))
    return per_request, per_token


def _measure_server(extra_args: list[str]) -> list[dict]:
    """One server: warm-up, then each calibration workload; CPU s of front and client each."""
    from benchmarks import sim_validation_engine as sv
    from deepinfer.bench.serve_client import run_benchmark
    from deepinfer.bench.workloads import build_workload

    runs = []
    with sv.warm_server(extra_args) as (proc, port, config):
        for output_len in OUTPUT_LENS:
            workload = build_workload(calibration_workload(output_len))
            before = sv.process_cpu_seconds(proc.pid)
            counters_before = sv.worker_counters(port)
            run = asyncio.run(run_benchmark(config, workload.requests))
            after = sv.process_cpu_seconds(proc.pid)
            counters_after = sv.worker_counters(port)
            failed = [r.error for r in run.results if not r.success]
            if failed:
                raise RuntimeError(f"calibration run failed: {failed[0]}")
            runs.append({"requests": NUM_REQUESTS,
                         "tokens": sum(r.output_len for r in workload.requests),
                         "front_cpu_s": after["front"] - before["front"],
                         "client_cpu_s": after["client"] - before["client"],
                         "load_average": os.getloadavg()[0],
                         # each P/D worker's steps and CPU on this fixed workload: the
                         # in-situ check of the profile's per-step cost (frozen calibration)
                         "workers": {w: {k: v - counters_before.get(w, {}).get(k, 0.0)
                                         for k, v in c.items()}
                                     for w, c in counters_after.items()}})
    return runs


def calibration_workload(output_len: int):
    """The fixed synthetic workload of one calibration run (never a trace)."""
    from deepinfer.bench.workloads import WorkloadConfig
    return WorkloadConfig(kind="random", num_prompts=NUM_REQUESTS, input_len=INPUT_LEN,
                          output_len=output_len, request_rate=RATE, seed=777 + output_len)


def costs_from_runs(colocated: list[dict], pd: list[dict]) -> dict:
    """Per shape, the front's and client's costs from its two calibration runs."""
    result = {}
    for shape, runs in (("colocated", colocated), ("pd", pd)):
        result[shape] = {}
        for role in ("front", "client"):
            per_request, per_token = _fit_two(
                [(r["requests"], r["tokens"], r[f"{role}_cpu_s"]) for r in runs])
            result[shape][f"{role}_cpu"] = {"per_request_s": per_request,
                                            "per_token_s": per_token}
    # The P/D front's extra per request is its handoff: charged at the handoff, not arrival.
    pd_front = result["pd"]["front_cpu"]
    per_request = min(pd_front["per_request_s"],
                      result["colocated"]["front_cpu"]["per_request_s"])
    pd_front["per_handoff_s"] = pd_front["per_request_s"] - per_request
    pd_front["per_request_s"] = per_request
    return result


def calibrate() -> dict:
    """Run the calibration workloads (colocated, then P/D) and fit the costs."""
    store_dir = tempfile.mkdtemp(prefix="sim-calibration-store-")
    print("calibrating the front's and client's CPU (colocated, then P=2/D=2) ...", flush=True)
    try:
        colocated = _measure_server([])
        pd = _measure_server(["--prefill-workers", "2", "--decode-workers", "2",
                              "--kv-store", f"fs://{store_dir}"])
    finally:
        shutil.rmtree(store_dir, ignore_errors=True)
    result = {**costs_from_runs(colocated, pd), "runs": {"colocated": colocated, "pd": pd},
              "workload": f"random {NUM_REQUESTS} x {INPUT_LEN} in / {OUTPUT_LENS} out, "
                          f"{RATE:g} req/s"}
    for shape in ("colocated", "pd"):
        print(f"  {shape}: " + "; ".join(
            f"{role} " + " + ".join(f"{1e3 * v:.3f} ms/{k[4:-2]}" for k, v in c.items())
            for role, c in result[shape].items()), flush=True)
    return result


def configure(choice: str | None, resimulate_only: bool) -> dict | None:
    """`sim_validation --host-cpu`: `measure` (the default with engine runs) calibrates now,
    `off` (the default with --measured: no engine runs) models no other CPU consumers, a
    path loads an earlier calibration. Returns the calibration in use (None: none)."""
    choice = choice or ("off" if resimulate_only else "measure")
    if choice == "off":
        use_calibration(None, enabled=False)
        return None
    if choice == "measure":
        calibration = calibrate()
    else:
        with open(choice) as f:
            calibration = json.load(f)
    use_calibration(calibration)
    return calibration


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where to write the calibration JSON")
    args = parser.parse_args(argv)
    result = calibrate()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
