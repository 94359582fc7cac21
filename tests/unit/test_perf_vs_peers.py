"""benchmarks/perf_vs_peers.py: the bounds, the issue-12 table and the argument checks
(the measurements themselves are the benchmark's job, not a test's)."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "perf_vs_peers.py"


@pytest.fixture(scope="module")
def pvp():
    spec = importlib.util.spec_from_file_location("perf_vs_peers", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bounds_from_peaks(pvp):
    w = {"input_len": 256, "output_len": 128, "ttft_len": 512}
    shape = {"layer_params": 100e6, "lm_head_params": 25e6}
    b = pvp.bounds(shape, {"bf16_matmul_gflop_s": 400.0, "read_gb_s": 25.0}, w)
    # per output token: 2 * (100M * 384 + 25M * 128) / 128 = 650 MFLOP -> 400e9 / 650e6
    assert b["w1_output_tok_s"] == pytest.approx(400e9 / 650e6)
    assert b["weight_bytes"] == 250e6  # bf16
    assert b["batch1_decode_tok_s"] == pytest.approx(100.0)
    assert b["ttft_512_s"] == pytest.approx(2 * (100e6 * 512 + 25e6) / 400e9)


def test_table_ratios_and_best_of_rounds(pvp):
    rounds = [{"DeepInfer": {"w1_output_tok_s": 300.0, "batch1_decode_tok_s": 40.0,
                             "ttft_512_s": 0.5},
               "llama.cpp": {"w1_output_tok_s": 200.0, "batch1_decode_tok_s": 80.0,
                             "ttft_512_s": 0.6}},
              {"DeepInfer": {"w1_output_tok_s": 330.0, "batch1_decode_tok_s": 38.0,
                             "ttft_512_s": 0.4},
               "llama.cpp": {"w1_output_tok_s": 220.0, "batch1_decode_tok_s": 86.0,
                             "ttft_512_s": 0.55}}]
    best = pvp.summarise(rounds)
    assert best["DeepInfer"] == {"w1_output_tok_s": 330.0, "batch1_decode_tok_s": 40.0,
                                 "ttft_512_s": 0.4}
    text = pvp.table(best, {"w1_output_tok_s": 550.0, "batch1_decode_tok_s": 115.0,
                            "ttft_512_s": 0.3})
    row = next(line for line in text.splitlines() if line.startswith("| DeepInfer"))
    # W1 330/220, batch-1 40/86, TTFT speed-up 0.55/0.4
    assert "| 1.50x | 0.47x | 1.38x |" in row
    assert "| bound (measured peaks) | 550.0 | 115.0 | 0.300 s |" in text


def test_missing_peers_is_a_usage_error(tmp_path):
    result = subprocess.run([sys.executable, str(SCRIPT), "--peer-work", str(tmp_path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "llama.cpp peers not found" in result.stderr and "--skip-llamacpp" in result.stderr
