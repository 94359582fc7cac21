"""Simulator vs the real engine on held-out workloads, from a frozen calibration only.

    .venv/bin/python benchmarks/sim_heldout.py \
        --calibration benchmarks/sim/calibration/cpu_smollm2_1thread.json \
        --repeats 2 --sim-samples 8 --out benchmarks/results/sim_heldout.json
    # the report again from those measured runs (no engine, nothing refitted):
    .venv/bin/python benchmarks/sim_heldout.py --measured benchmarks/results/sim_heldout.json

Nothing is measured or fitted here: the profile and the host-CPU costs come from the frozen
manifest (`sim_frozen_calibration.py`; its files' sha256 are checked), and every case is a
window of a public trace that no development run used (`HELD_OUT`: requests 1000-1039 of each
trace; development used requests 0-39). Each case runs the real `deepinfer serve` `--repeats`
times (fresh server, empty store) and the simulator `--sim-samples` times; the headline is
the simulated mean against the measured mean, with the split stated on every row.

Traces are looked up by file name in --traces-dir, then in shared/traces (and its
subfolders) beside the checkout or above it, then $DEEPINFER_TRACES; `HELD_OUT` says where each comes from and its licence.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deepinfer.bench.traces import ShrinkConfig  # noqa: E402
from deepinfer.bench.workloads import WorkloadConfig, build_workload  # noqa: E402

HEADLINE = ("ttft_ms_p50", "tpot_ms_p50", "output_throughput")
TARGET = 0.15


@dataclass(frozen=True)
class HeldOutCase:
    name: str
    trace_file: str
    source: str  # repository and path, licence
    shape: str
    length_scale: float = 0.25
    pd: bool = False
    start: int = 1000
    num_prompts: int = 40
    time_scale: float = 0.1

    def workload_config(self, path: str) -> WorkloadConfig:
        return WorkloadConfig(kind=f"trace:{path}", num_prompts=self.num_prompts,
                              time_scale=self.time_scale, trace_start=self.start,
                              shrink=ShrinkConfig(self.length_scale, 768, 48))

    def describe(self) -> str:
        return (f"{self.name}: {self.trace_file} requests {self.start}-"
                f"{self.start + self.num_prompts - 1}, lengths x{self.length_scale:g}, <= 768 / "
                f"<= 48, time x{self.time_scale:g}, {'P=2/D=2' if self.pd else 'colocated'}")


AZURE_CODE = ("AzureLLMInferenceTrace_code.csv", "Azure/AzurePublicDataset data/ (CC-BY 4.0)",
              "code completion: long prompts, short outputs, bursty (inter-arrival CV ~5)")
SYNTHETIC = ("synthetic_trace.jsonl", "kvcache-ai/Mooncake FAST25-release/traces (Apache-2.0)",
             "multi-turn with long shared prefixes (hash ids), Poisson arrivals")
CONVERSATION = ("conversation_trace.jsonl", "kvcache-ai/Mooncake FAST25-release/traces "
                "(Apache-2.0)", "conversation: multi-turn, shared system prompt")
AZURE_CONV = ("AzureLLMInferenceTrace_conv.csv", "Azure/AzurePublicDataset data/ (CC-BY 4.0)",
              "conversation: short prompts, medium outputs")
HELD_OUT = [
    HeldOutCase(f"{label}{'-pd' if pd else ''}", *trace, length_scale=scale, pd=pd)
    for label, trace, scale in (("azure-code", AZURE_CODE, 0.25),
                                ("mooncake-synthetic", SYNTHETIC, 0.25),
                                ("mooncake-conversation", CONVERSATION, 0.05),
                                ("azure-conv", AZURE_CONV, 0.25))
    for pd in (False, True)]


def find_trace(name: str, dirs: list[Path]) -> str:
    for d in dirs:
        for candidate in [d / name, *d.glob(f"*/{name}")]:
            if candidate.exists():
                return str(candidate)
    raise SystemExit(f"sim_heldout: trace {name} not found in {', '.join(map(str, dirs))}")


def pools(case: HeldOutCase) -> dict:
    return ({"prefill": {"workers": 2}, "decode": {"workers": 2}} if case.pd
            else {"colocated": {"workers": 1}})


def run_case(case: HeldOutCase, workload, profile: str, runs: list[dict], samples: int,
             step_time_cv: float | None) -> dict:
    from benchmarks.sim_validation import (case_report, sample_noise, simulate_case)
    args = argparse.Namespace(step_time_cv=step_time_cv)
    sim_run, sims = simulate_case(profile, pools(case), workload, sample_noise(args, runs),
                                  samples)
    report = case_report(case.name, workload, runs, sim_run, sims, profile, pools(case))
    report["split"] = "held out"
    report["case"] = dataclasses.asdict(case)
    return report


def measure(case: HeldOutCase, workload, repeats: int, store_dir: str) -> list[dict]:
    from benchmarks.sim_validation_engine import serve_and_bench
    runs = []
    for i in range(repeats):
        extra = (["--prefill-workers", "2", "--decode-workers", "2",
                  "--kv-store", f"fs://{os.path.join(store_dir, f'{case.name}-{i}')}"]
                 if case.pd else [])
        print(f"[{case.name}] real engine, run {i + 1}/{repeats}", flush=True)
        runs.append(serve_and_bench(extra, workload))
    return runs


def table(cases: dict) -> str:
    """The markdown table docs/simulator.md shows (error of the simulated mean)."""
    lines = ["| case (split: held out) | TTFT p50 | TPOT p50 | output tok/s | TTFT mean | "
             "within 15% |", "|---|---|---|---|---|---|"]
    for name, case in cases.items():
        rows = case["comparison"]
        errs = [rows[k]["error_of_mean"] for k in (*HEADLINE, "ttft_ms_mean")]
        ok = all(e is not None and abs(e) <= TARGET for e in errs[:3])
        cells = " | ".join("n/a" if e is None else f"{100 * e:+.1f}%" for e in errs)
        lines.append(f"| {name} | {cells} | {'yes' if ok else 'no'} |")
    return "\n".join(lines)


def main() -> None:
    from benchmarks.sim_frozen_files import load_frozen
    from benchmarks.sim_validation import loaded_runs, write
    from benchmarks.sim_validation_cluster import use_rules
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibration",
                        default=str(ROOT / "benchmarks/sim/calibration/cpu_smollm2_1thread.json"))
    parser.add_argument("--cases", default=None, help="comma list of HELD_OUT names")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--sim-samples", type=int, default=8)
    parser.add_argument("--step-time-cv", type=float, default=None)
    parser.add_argument("--measured", default=None, metavar="JSON[,JSON...]",
                        help="re-simulate the measured runs of earlier outputs (no engine)")
    parser.add_argument("--traces-dir", action="append", default=None)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/sim_heldout.json"))
    args = parser.parse_args()
    try:
        frozen = load_frozen(args.calibration)
    except (OSError, ValueError, KeyError) as e:
        parser.exit(2, f"sim_heldout: {e}\n")
    chosen = [c for c in HELD_OUT if args.cases is None or c.name in args.cases.split(",")]
    if not chosen or args.repeats < 1 or args.sim_samples < 1:
        parser.exit(2, "sim_heldout: no such case, or --repeats / --sim-samples < 1\n")
    shared = [p / "shared" / "traces" for p in ROOT.parents if (p / "shared" / "traces").is_dir()]
    dirs = [Path(d) for d in (args.traces_dir or [])] + shared + (
        [Path(os.environ["DEEPINFER_TRACES"])] if os.environ.get("DEEPINFER_TRACES") else [])
    from benchmarks.sim_frozen_files import host_cpu_with_derived
    from benchmarks.sim_validation_calibration import use_calibration
    use_calibration(host_cpu_with_derived(frozen))
    use_rules(frozen.get("simulator", {}))
    report = {"calibration": {k: frozen.get(k) for k in (
                  "name", "measured_at", "git_commit", "profile_sha256", "host_cpu_sha256",
                  "simulator", "derived")},
              "split": frozen["split"], "repeats": args.repeats, "sim_samples": args.sim_samples,
              "measured_from": args.measured, "cases": {}}
    if args.measured:
        report["repeats"] = None  # the runs come from the files named in measured_from
    store_dir = tempfile.mkdtemp(prefix="sim-heldout-store-")
    try:
        for case in chosen:
            workload = build_workload(case.workload_config(find_trace(case.trace_file, dirs)))
            runs = (loaded_runs(args.measured.split(","), case.name) if args.measured
                    else measure(case, workload, args.repeats, store_dir))
            if not runs:
                continue
            report["cases"][case.name] = run_case(case, workload, frozen["profile_path"], runs,
                                                  args.sim_samples, args.step_time_cv)
            write(args.out, report)
    finally:
        shutil.rmtree(store_dir, ignore_errors=True)
    report["table"] = table(report["cases"])
    write(args.out, report)
    print(report["table"])
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
