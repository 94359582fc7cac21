"""benchmarks/sim_validation.py compares like with like: the mean of N measured runs against
the mean of K perturbed simulations (with both spreads), keeps every run, says where a TTFT p50
sits among the steps, and re-simulates earlier measured runs without an engine."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from deepinfer.bench.latency_stats import BenchSummary, LatencyStats
from tests.unit.test_sim_validation_script import load_script

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def summary(ttft_p50: float, tpot_p50: float, throughput: float,
            ttft_mean: float | None = None) -> BenchSummary:
    def stats(p50, mean=None):
        return LatencyStats(mean if mean is not None else p50, p50, p50, p50, p50, 10)
    return BenchSummary(10, 10, 0, 1.0, 100, 100, 10.0, throughput, 2 * throughput,
                        stats(ttft_p50, ttft_mean), stats(tpot_p50), stats(tpot_p50),
                        stats(1000.0), None, None, None)


def test_repeat_rows_compare_means_and_keep_single_run_errors():
    sv = load_script()
    measured = [summary(100, 10, 40), summary(120, 12, 50)]
    samples = [summary(95, 11, 44), summary(105, 11, 48), summary(115, 11, 46)]
    rows = sv.repeat_rows(measured, summary(90, 11, 50), samples)
    thr = rows["output_throughput"]
    assert thr["measured_runs"] == [40, 50] and thr["measured_mean"] == 45
    assert (thr["measured_min"], thr["measured_max"]) == (40, 50)
    assert thr["simulated_band"] == {"mean": 46, "lo": 44, "hi": 48, "kind": "min-max", "n": 3}
    assert thr["error_of_mean"] == pytest.approx(46 / 45 - 1) and thr["within_target"]
    assert thr["single_run_errors"] == pytest.approx([50 / 40 - 1, 0.0])
    ttft = rows["ttft_ms_p50"]
    assert ttft["error_of_mean"] == pytest.approx(105 / 110 - 1)
    # without samples the deterministic run is the simulated mean
    alone = sv.repeat_rows(measured, summary(90, 11, 60))["output_throughput"]
    assert alone["simulated_band"] is None and alone["error_of_mean"] == pytest.approx(60 / 45 - 1)
    assert alone["within_target"] is False
    assert "error of mean +2.2% within 15%: yes" in sv.format_repeat_rows(rows)


def test_p50_on_a_step_boundary_and_its_swing():
    sv = load_script()
    # W1's shape: 32 prompts at once, 8 per step: first tokens in groups of 8 about 2.3 s apart
    steps = [300.0, 2630.0, 4960.0, 7300.0]
    times = [t + 0.5 * i for t in steps for i in range(8)]
    pos = sv.p50_position(times)
    assert pos["num_steps"] == 4 and pos["step_sizes"] == [8, 8, 8, 8]
    assert pos["on_step_boundary"] and pos["margin_requests"] == 0
    assert pos["p50_ms"] == pytest.approx((2633.5 + 4960.0) / 2)
    # one request more or fewer out before it moves the p50 by about half a step
    earlier, later = pos["swing"]
    assert earlier == pytest.approx(-0.30, abs=0.02) and later == pytest.approx(0.30, abs=0.02)
    # 6 / 20 / 6: the p50 sits mid-step, 10 requests from either edge
    middle = [100.0] * 6 + [2000.0 + i for i in range(20)] + [4000.0] * 6
    inside = sv.p50_position(middle)
    assert not inside["on_step_boundary"] and inside["margin_requests"] == 10
    assert abs(inside["swing"][0]) < 0.001 and sv.p50_position([1.0, 2.0]) is None


def test_bad_arguments_exit_2(capsys):
    sv = load_script()
    for argv in (["--repeats", "0"], ["--sim-samples", "0"], ["--measured", "x.json"],
                 ["--cases", "w2"], ["--step-time-cv", "1.5"]):
        with pytest.raises(SystemExit) as e:
            sv.parse_args(argv)
        assert e.value.code == 2, argv
        assert capsys.readouterr().err.startswith("sim_validation: ")


def test_resimulating_earlier_runs_compares_with_their_mean(tmp_path, capsys):
    sv = load_script()
    profile = tmp_path / "profile.json"  # its CPU-clock refit is written beside it
    shutil.copy(RESULTS / "sim_validation_profile.json", profile)
    with open(RESULTS / "sim_validation.json") as f:
        stored = json.load(f)["cases"]["w1"]["measured_summary"]
    faster = {**stored, "output_throughput": 1.1 * stored["output_throughput"]}
    # an output from before repeats (one run per case) and one that kept two runs
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    old.write_text(json.dumps({"cases": {"w1": {"measured_summary": stored}}}))
    new.write_text(json.dumps({"cases": {"w1": {"measured_summary": stored, "measured_runs": [
        {"summary": stored, "send_lag_ms": 2.0}, {"summary": faster, "send_lag_ms": 4.0}]}}}))
    out = tmp_path / "out.json"
    sv.main(["--profile", str(profile), "--measured", f"{old},{new}", "--cases", "w1",
             "--sim-samples", "3", "--step-time-cv", "0.03", "--out", str(out)])
    case = json.loads(out.read_text())["cases"]["w1"]
    assert case["num_measured_runs"] == 3 and case["num_sim_samples"] == 3
    assert [r["summary"] for r in case["measured_runs"]] == [stored, stored, faster]
    thr = case["comparison"]["output_throughput"]
    assert thr["measured_mean"] == pytest.approx(stored["output_throughput"] * 3.1 / 3)
    assert thr["measured_max"] == pytest.approx(faster["output_throughput"])
    assert thr["simulated_band"]["n"] == 3 and thr["simulated_band"]["lo"] < thr[
        "simulated_band"]["hi"]
    samples = case["simulated_samples"]
    assert samples["step_time_cv"] == {"colocated": 0.03}
    assert samples["arrival_jitter_ms"] == pytest.approx(3.0)  # the runs' mean send lag
    assert case["errors"]["output_throughput"]["measured"] == pytest.approx(
        stored["output_throughput"])  # the single-run keys as before: the first run
    assert len(case["errors_per_run"]) == 3
    assert case["ttft_p50_position"]["simulated"]["num_steps"] >= 4
    printed = capsys.readouterr().out
    assert "error of mean" in printed and "TTFT p50 simulated" in printed
