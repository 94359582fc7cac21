"""The fs prefix store shared by real processes: hashes agree, blocks are never half-read."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CHILD = str(Path(__file__).with_name("kvstore_child.py"))
pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]


def child_env(hash_seed: int) -> dict[str, str]:
    return {**os.environ, "PYTHONHASHSEED": str(hash_seed)}


def run_child(mode: str, url: str, hash_seed: int) -> dict:
    out = subprocess.run([sys.executable, CHILD, mode, url], env=child_env(hash_seed),
                         capture_output=True, text=True, timeout=30, check=True)
    return json.loads(out.stdout)


def test_block_written_by_one_process_is_read_by_another(tmp_path):
    url = f"fs://{tmp_path}"
    written = run_child("write", url, hash_seed=1)
    read = run_child("read", url, hash_seed=2)
    # Different PYTHONHASHSEED (str hashes differ), identical chained block hashes.
    assert written["str_hash"] != read["str_hash"]
    assert written["hashes"] == read["hashes"] and len(read["hashes"]) == 12
    assert written["stats"]["num_puts"] == 12
    assert read["longest_prefix"] == 12 and read["bad_payloads"] == 0
    assert read["stats"]["num_hits"] == 12 and read["stats"]["num_corrupt"] == 0


def test_concurrent_writers_never_expose_a_partial_block(tmp_path):
    url = f"fs://{tmp_path}"
    procs = [subprocess.Popen([sys.executable, CHILD, mode, url, "1.5"], env=child_env(i),
                              stdout=subprocess.PIPE, text=True)
             for i, mode in enumerate(["churn", "churn", "poll"])]
    results = []
    for p in procs:
        stdout, _ = p.communicate(timeout=30)
        assert p.returncode == 0
        results.append(json.loads(stdout))
    poll = results[2]["stats"]
    assert poll["num_hits"] > 0, poll  # the reader did overlap with the writers
    assert poll["num_corrupt"] == 0 and results[2]["bad_payloads"] == 0, poll
