"""The fs prefix store shared by real processes: hashes agree, blocks are never half-read,
and the capacity (LRU by file mtime) holds across processes writing one directory."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer.kvstore.block_codec import HEADER_LEN
from deepinfer.kvstore.fs_store import FsKVBlockStore
from tests.integration.kvstore_child import FILL_BYTES, SALT, long_hashes

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


def run_children(mode: str, url: str, args: list[str]) -> list[dict]:
    """One child per arg, all running at once."""
    procs = [subprocess.Popen([sys.executable, CHILD, mode, url, arg], env=child_env(i),
                              stdout=subprocess.PIPE, text=True) for i, arg in enumerate(args)]
    results = []
    for p in procs:
        stdout, _ = p.communicate(timeout=30)
        assert p.returncode == 0
        results.append(json.loads(stdout))
    return results


FILL_BLOCK_BYTES = HEADER_LEN + FILL_BYTES  # one encoded block of the fill mode (no layout)


def present(root: Path) -> list[int]:
    store = FsKVBlockStore(SALT, root)
    return [i for i, h in enumerate(long_hashes()) if store.contains(h)]


def test_concurrent_writers_stay_near_the_shared_capacity(tmp_path):
    cap = 40 * FILL_BLOCK_BYTES
    url = f"fs://{tmp_path}?capacity_bytes={cap}"
    results = run_children("fill", url, ["0:60", "60:60", "120:60"])  # 4.5x the capacity
    assert all(r["capacity_bytes"] == cap and r["stats"]["num_puts"] == 60 for r in results)
    assert sum(r["stats"]["num_evicted"] for r in results) > 0
    # Each writer rescans after rescan_fraction (1/8) of the capacity of its own writes.
    probe = FsKVBlockStore(SALT, tmp_path)
    assert probe.num_bytes() <= cap * (1 + 3 / 8) + 3 * 2 * FILL_BLOCK_BYTES
    run_children("fill", url, ["180:1"])  # a fresh process rescans at its first write
    assert probe.num_bytes() <= cap
    assert 180 in present(tmp_path)


def test_a_read_in_one_process_keeps_a_block_from_eviction_by_another(tmp_path):
    url = f"fs://{tmp_path}?capacity_bytes={int(8.5 * FILL_BLOCK_BYTES)}"
    run_children("fill", url, ["0:8"])  # at capacity, nothing evicted
    assert present(tmp_path) == list(range(8))
    [touched] = run_children("touch", url, ["0"])  # block 0 becomes the most recently used
    assert touched["stats"]["num_hits"] == 1 and touched["bad_payloads"] == 0
    [filled] = run_children("fill", url, ["8:4"])  # evicts the least recently used
    assert filled["stats"]["num_evicted"] >= 3
    kept = present(tmp_path)
    assert 0 in kept and 1 not in kept and set(range(8, 12)) <= set(kept)
    assert FsKVBlockStore(SALT, tmp_path).num_bytes() <= 8.5 * FILL_BLOCK_BYTES
