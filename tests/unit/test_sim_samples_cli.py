"""`deepinfer simulate --samples K` keeps the bench-serve JSON of the described run and adds a
`samples` section; the profiler stores the step-time CV its repeats measured."""
from __future__ import annotations

import json

import pytest

from deepinfer.cli.main import main
from tests.unit.test_sim_cli import write_cluster

ARGS = ["--num-prompts", "10", "--input-len", "96", "--output-len", "8", "--request-rate",
        "30"]


def test_simulate_samples_adds_bands_and_keeps_the_summary(tmp_path, capsys):
    path = write_cluster(tmp_path, {"prefill": {"workers": 2}, "decode": {"workers": 1}})
    data = json.loads(open(path).read())
    data["noise"] = {"step_time_cv": 0.05}
    noisy = tmp_path / "noisy.json"
    noisy.write_text(json.dumps(data))
    plain_out, sampled_out = tmp_path / "plain.json", tmp_path / "sampled.json"
    assert main(["simulate", "--cluster", path, *ARGS, "--json", str(plain_out)]) == 0
    assert main(["simulate", "--cluster", path, *ARGS, "--json", str(sampled_out),
                 "--samples", "3", "--compare", str(plain_out)]) == 0
    out = capsys.readouterr().out
    assert "3 samples" in out and "inside" in out
    plain, sampled = json.loads(plain_out.read_text()), json.loads(sampled_out.read_text())
    assert sampled["summary"] == plain["summary"]  # the cluster file has no noise: deterministic
    samples = sampled["samples"]
    assert samples["num_samples"] == 3 and samples["seeds"] == [0, 1, 2]
    assert samples["band"] == "min-max" and len(samples["per_sample"]) == 3
    ttft = samples["metrics"]["ttft_ms_p50"]
    assert ttft["lo"] <= ttft["mean"] <= ttft["hi"]
    # a noise section in the cluster file: its CV, and the top-level run is perturbed too
    assert main(["simulate", "--cluster", str(noisy), *ARGS, "--json", str(sampled_out),
                 "--samples", "2"]) == 0
    noisy_json = json.loads(sampled_out.read_text())
    assert noisy_json["samples"]["step_time_cv"] == {"prefill": 0.05, "decode": 0.05}
    assert noisy_json["summary"] != plain["summary"]


def test_simulate_bad_samples_is_exit_2(tmp_path, capsys):
    path = write_cluster(tmp_path, {"colocated": {"workers": 1}})
    assert main(["simulate", "--cluster", path, *ARGS, "--samples", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--samples must be >= 1" in err and "\n" not in err


def test_profile_stores_the_repeats_step_time_cv():
    from deepinfer.runtime.profiler import QUICK_GRID, grid_with, profile_cost_model
    from tests.unit.test_profiler import SHAPE, FakeRunner
    grid = grid_with(QUICK_GRID, num_ragged=2, num_repeats=3)
    noisy = profile_cost_model(FakeRunner(noise=0.1), SHAPE, 1000, grid)
    # FakeRunner: × (1 + 0.1 · U(-1, 1)), a CV of 0.1 / sqrt(3)
    assert noisy.metadata["step_time_cv"] == pytest.approx(0.1 / 3 ** 0.5, rel=0.3)
    quiet = profile_cost_model(FakeRunner(noise=0.0), SHAPE, 1000, grid)
    assert quiet.metadata["step_time_cv"] == pytest.approx(0.0, abs=1e-12)
    once = profile_cost_model(FakeRunner(), SHAPE, 1000, grid_with(grid, num_repeats=1))
    assert once.metadata["step_time_cv"] is None
