"""A frozen calibration is only read: its files' hashes are checked, and the derived P/D prefill
term comes from its own P/D runs (benchmarks/sim_frozen_calibration.py)."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.sim_frozen_calibration import derived_terms  # noqa: E402
from benchmarks.sim_frozen_files import host_cpu_with_derived, load_frozen  # noqa: E402

FROZEN = ROOT / "benchmarks" / "sim" / "calibration" / "cpu_smollm2_1thread.json"


def test_the_committed_calibration_loads_and_states_its_split():
    frozen = load_frozen(str(FROZEN))
    assert Path(frozen["profile_path"]).exists() and Path(frozen["host_cpu_path"]).exists()
    assert frozen["simulator"] == {"host_sharing": "fair", "time_sharing": False,
                                   "memory_contention": False}
    held_out = " ".join(frozen["split"]["held_out"])
    assert "requests 1000-1039" in held_out and "requests 0-39" not in held_out
    assert all("1000" not in d for d in frozen["split"]["development"])
    host = host_cpu_with_derived(frozen)
    assert host["pd"]["prefill_cpu"]["per_handoff_s"] == pytest.approx(
        frozen["derived"]["prefill_cpu_per_handoff_s"])


def test_a_changed_file_is_refused(tmp_path):
    data = json.loads(FROZEN.read_text())
    for key in ("profile", "host_cpu"):
        shutil.copy(FROZEN.parent / data[key], tmp_path / data[key])
    manifest = tmp_path / "m.json"
    manifest.write_text(json.dumps(data))
    load_frozen(str(manifest))  # intact copy: fine
    with open(tmp_path / data["host_cpu"], "a") as f:
        f.write(" ")
    with pytest.raises(ValueError, match="changed since it was frozen"):
        load_frozen(str(manifest))
    (tmp_path / data["profile"]).unlink()
    with pytest.raises(ValueError, match="missing"):
        load_frozen(str(manifest))


def test_derived_prefill_term_is_the_measured_excess_per_request():
    host = {"runs": {"pd": [{"requests": 10, "tokens": 80}, {"requests": 10, "tokens": 640}]}}
    rows = {"output_8": {"prefill": {"measured_cpu_s": 3.0, "simulated_work_s": 2.0}},
            "output_64": {"prefill": {"measured_cpu_s": 4.0, "simulated_work_s": 2.0}}}
    profile = {"model_shape": {"kv_bytes_per_token": 1000},
               "metadata": {"kv_transport": {"cpu_s_per_gb": {"sender": 0.0}}}}
    out = derived_terms(rows, host, profile)
    assert out["prefill_cpu_per_handoff_runs_s"] == pytest.approx([0.1, 0.2])
    assert out["prefill_cpu_per_handoff_s"] == pytest.approx(0.15)


def test_sim_validation_takes_a_frozen_calibration_and_its_rules(capsys):
    import benchmarks.sim_validation as sv
    args, _ = sv.parse_args(["--calibration", str(FROZEN), "--cases", "w1"])
    assert args.profile.endswith("cpu_smollm2_1thread_profile.json")
    assert args.host_cpu.endswith("cpu_smollm2_1thread_host_cpu.json")
    assert sv.memory_contention_key(args.profile) == {}  # the rules keep it out
    assert sv.time_sharing_key(args.profile) == {}
    sv.use_rules({"memory_contention": True, "time_sharing": True})  # restore the defaults
    with pytest.raises(SystemExit) as exit_info:
        sv.parse_args(["--calibration", str(FROZEN), "--profile", "x.json"])
    assert exit_info.value.code == 2
    assert "brings its own profile" in capsys.readouterr().err
