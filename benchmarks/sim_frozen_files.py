"""Reading a frozen simulator calibration (written by `sim_frozen_calibration.py`): its manifest
with the files' hashes checked, and the host-CPU section the simulated clusters take. Apart from
the script that measures it, so the validation scripts read it without importing that one."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def host_cpu_with_derived(frozen: dict) -> dict:
    """The frozen host-CPU calibration plus the derived P/D prefill term, as the simulated
    clusters' `host` section takes it."""
    host_cpu = json.loads(Path(frozen["host_cpu_path"]).read_text())
    term = (frozen.get("derived") or {}).get("prefill_cpu_per_handoff_s")
    if term:
        host_cpu["pd"] = {**host_cpu["pd"], "prefill_cpu": {"per_handoff_s": term}}
    return host_cpu


def load_frozen(path: str) -> dict:
    """The manifest with absolute `profile_path` / `host_cpu_path`; ValueError when a file is
    missing or its hash differs from the frozen one (a refit is a new calibration)."""
    manifest_path = Path(path)
    data = json.loads(manifest_path.read_text())
    for key in ("profile", "host_cpu"):
        file = manifest_path.parent / data[key]
        if not file.exists():
            raise ValueError(f"{path}: {data[key]} is missing")
        if sha256(file) != data[f"{key}_sha256"]:
            raise ValueError(f"{path}: {data[key]} changed since it was frozen "
                             "(sha256 differs); a new measurement is a new calibration name")
        data[f"{key}_path"] = str(file)
    return data
