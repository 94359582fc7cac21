"""`deepinfer simulate` / `plan`: bench-serve JSON keys, --compare, and one-line errors."""
from __future__ import annotations

import json
from pathlib import Path

from deepinfer.cli.main import main

PROFILE = str(Path(__file__).resolve().parents[2] / "benchmarks" / "results"
              / "cost_profile_smollm2_bf16_cpu_1thread.json")
BENCH_KEYS = {"date", "host", "base_url", "model", "endpoint", "workload", "workload_config",
              "summary", "prefix_cache_hit_rate", "slo", "requests"}


def write_cluster(tmp_path, pools) -> str:
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"cost": {"profile": PROFILE}, "engine": {"num_kv_blocks": 512},
                                "pools": pools}))
    return str(path)


def test_simulate_writes_bench_serve_json_and_compares(tmp_path, capsys):
    cluster = write_cluster(tmp_path, {"prefill": {"workers": 1}, "decode": {"workers": 1}})
    out = tmp_path / "sim.json"
    args = ["simulate", "--cluster", cluster, "--num-prompts", "6", "--input-len", "64",
            "--output-len", "8", "--request-rate", "10", "--json", str(out)]
    assert main(args) == 0
    data = json.loads(out.read_text())
    assert BENCH_KEYS <= set(data)
    assert data["summary"]["num_completed"] == 6
    assert len(data["requests"]["ttft_s"]) == 6
    assert set(data["simulation"]["pools"]) == {"prefill", "decode"}
    capsys.readouterr()
    assert main(args[:-2] + ["--compare", str(out), "--workers", "decode=2"]) == 0
    assert "ttft_p50_ms" in capsys.readouterr().out


def test_simulate_bad_cluster_is_one_line_exit_2(tmp_path, capsys):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"pools": {"colocated": {}}, "cost": {"profile": PROFILE},
                                "hosts": {}}))
    assert main(["simulate", "--cluster", str(path), "--num-prompts", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("deepinfer simulate: error:") and "unknown keys" in err
    assert "\n" not in err
    assert main(["simulate", "--cluster", str(tmp_path / "missing.yaml")]) == 2


def test_plan_finds_a_configuration(tmp_path, capsys):
    cluster = write_cluster(tmp_path, {"colocated": {"workers": 1}})
    out = tmp_path / "plan.json"
    assert main(["plan", "--cluster", cluster, "--num-prompts", "12", "--input-len", "64",
                 "--output-len", "8", "--request-rate", "20", "--slo-ttft-ms", "100000",
                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["best"]["workers"] == {"colocated": 1}
    assert main(["plan", "--cluster", cluster, "--num-prompts", "2"]) == 2  # no SLO given
