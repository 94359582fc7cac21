"""`deepinfer profile` on the real default model and runner: writes a profile with
coefficients and held-out errors that the engine can load; bad arguments exit 2. ~25 s."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from deepinfer.core.cost_model import FEATURE_NAMES, ChunkShape, CostModel

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    # Not `-m deepinfer.cli.main`: as __main__ that module's CLIError is a different class.
    code = "import sys; from deepinfer.cli.main import main; sys.exit(main())"
    return subprocess.run([sys.executable, "-c", code, "profile", *args],
                          capture_output=True, text=True, timeout=560)


def test_quick_profile_of_the_default_model(tmp_path):
    out = tmp_path / "profile.json"
    proc = run_cli("--grid", "quick", "--repeats", "1", "--threads", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "held-out abs error" in proc.stdout
    data = json.loads(out.read_text())
    assert set(data["coefficients"]) == set(FEATURE_NAMES)
    assert data["holdout_median_abs_pct_error"] >= 0 and data["holdout_p90_abs_pct_error"] >= 0
    assert data["metadata"]["threads"] == 1 and data["metadata"]["dtype"] == "bfloat16"
    model = CostModel.from_dict(data)
    # Physically sensible: more work never predicts less time.
    small = model.predict([ChunkShape(0, 32)])
    assert 0 < small < model.predict([ChunkShape(0, 256)]) < model.predict([ChunkShape(2048, 256)])
    assert model.predict([ChunkShape(64, 1)] * 8) < model.predict([ChunkShape(2048, 1)] * 8)


def test_bad_arguments_exit_2_with_one_line(tmp_path):
    for args in (("--out", str(tmp_path / "missing" / "p.json")),
                 ("--repeats", "0", "--out", str(tmp_path / "p.json")),
                 ("--grid", "huge", "--out", str(tmp_path / "p.json"))):
        proc = run_cli(*args)
        assert proc.returncode == 2, (args, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1 and "error" in proc.stderr
