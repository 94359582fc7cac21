"""The published DeepSeek-V3 deployments: calibrated on DeepSeek's profile, the held-out
figures within 15% (the command in docs/simulator.md, `benchmarks/sim_published.py`)."""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

from deepinfer.sim import published_deployments as published
from deepinfer.sim.deployments import Deployment, calibrate, predict, solve_scale

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.sim_published import report  # noqa: E402

# Misses the docs state (the model has no cause for them); strict: a fix shows up as XPASS.
KNOWN_MISSES = {
    "vllm-gb200-decode": "17% below: no sourced mechanism yet (decode attention at the "
                         "H800-calibrated efficiency is 64% of the step)",
}


@pytest.fixture(scope="module")
def out():
    return report()


def test_calibration_reproduces_deepseeks_profile_and_is_one_number(out):
    cal = out["calibration"]
    assert set(cal["per_deployment"]) == {d.name for d in published.CALIBRATION}
    # the two phases ask for nearly the same scale: one number serves both
    a, b = cal["per_deployment"].values()
    assert abs(a / b - 1) < 0.05
    for row in out["deployments"]:
        if row["split"] == "calibration":
            assert abs(row["error"]) < 0.02, row


@pytest.mark.parametrize("name", [d.name for d in published.sglang(0.5) + published.vllm(0.5)])
def test_held_out_deployment_within_15_percent(out, name, request):
    if name in KNOWN_MISSES:
        request.applymarker(pytest.mark.xfail(strict=True, reason=KNOWN_MISSES[name]))
    row = next(r for r in out["deployments"] if r["name"] == name)
    assert row["split"] == "held out"
    assert abs(row["error"]) <= 0.15, f"{name}: {100 * row['error']:+.1f}%"


def test_eplb_speedups_within_15_percent(out):
    for phase, e in out["eplb_speedup"].items():
        assert e["imbalance_without"] > e["imbalance_with"] >= 1.0
        assert abs(e["predicted_speedup"] / e["published_speedup"] - 1) <= 0.15, (phase, e)


def test_prediction_moves_with_the_mechanisms():
    scale = calibrate(published.CALIBRATION)["efficiency_scale"]
    base = next(d for d in published.sglang(0.5) if d.name == "sglang-decode")
    slow_link = predict(replace(base, accelerator="H800"), scale)  # same NIC: ~same
    serial = predict(replace(base, overlap_speedup=None, overlap=0.0), scale)
    hidden = predict(replace(base, overlap_speedup=None, overlap=1.0), scale)
    assert serial.predicted_tok_s < predict(base, scale).predicted_tok_s < hidden.predicted_tok_s
    assert slow_link.predicted_tok_s == pytest.approx(predict(base, scale).predicted_tok_s,
                                                      rel=0.05)
    fp8 = predict(replace(published.vllm(0.5)[0], expert_dtype=None), scale)
    assert fp8.predicted_tok_s < predict(published.vllm(0.5)[0], scale).predicted_tok_s
    # a deployment no scale can reproduce is refused, not fitted
    impossible = replace(base, published_tok_s=1e9)
    with pytest.raises(ValueError, match="no efficiency scale"):
        solve_scale(impossible)


def test_bad_deployments_are_refused():
    with pytest.raises(ValueError, match="phase"):
        Deployment("x", "", "train", "H800", 1.0, seqs_per_gpu=1)
    with pytest.raises(ValueError, match="positive"):
        Deployment("x", "", "decode", "H800", 1.0)
    with pytest.raises(ValueError, match="overlap_speedup"):
        Deployment("x", "", "decode", "H800", 1.0, seqs_per_gpu=1, overlap_speedup=0.5)
