"""Prefix store backends (fs, memory), the write-through writer and the URL factory."""
from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from deepinfer.core.prefix_hash import hash_request_blocks, salt_hash
from deepinfer.kvstore import KVStoreWriter, open_store
from deepinfer.kvstore.factory import DEFAULT_FS_CAPACITY_BYTES, with_capacity
from deepinfer.kvstore.block_codec import HEADER_LEN
from deepinfer.kvstore.fs_store import FsKVBlockStore, default_store_root
from deepinfer.kvstore.memory_store import MemoryKVBlockStore

SALT = salt_hash("SmolLM2-135M", "float32", "16", "test-layout")
HASHES = hash_request_blocks(list(range(160)), 16)  # 10 chained block hashes


def payload(i: int, size: int = 1000) -> bytes:
    return bytes([i % 256]) * size


class FakeClock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture(params=["fs", "memory"])
def store(request, tmp_path):
    s = open_store(str(tmp_path) if request.param == "fs" else "memory", SALT, layout="L")
    yield s
    s.close()


def test_put_get_contains_and_longest_prefix(store):
    for i in (0, 1, 2, 4):
        store.put(HASHES[i], payload(i))
    assert store.get(HASHES[1]) == payload(1)
    assert store.get(HASHES[3]) is None
    assert store.contains(HASHES[4]) and not store.contains(HASHES[3])
    assert store.longest_prefix(HASHES) == 3
    assert store.longest_prefix([]) == 0
    store.put(HASHES[0], payload(0))  # already there: skipped
    st = store.stats()
    assert (st.num_hits, st.num_misses, st.num_puts, st.num_put_skipped) == (1, 1, 4, 1)
    assert st.bytes_read == 1000 and st.bytes_written == 4 * (HEADER_LEN + 1 + 1000)


def _corrupt(store, block_hash: bytes) -> None:
    if isinstance(store, FsKVBlockStore):
        path = store.block_path(block_hash)
        data = bytearray(path.read_bytes())
        data[-7] ^= 0xFF
        path.write_bytes(bytes(data))
    else:
        data = bytearray(store._blocks[block_hash])
        data[-7] ^= 0xFF
        store._blocks[block_hash] = bytes(data)


def test_corrupt_block_is_a_counted_miss_and_is_deleted(store, caplog):
    store.put(HASHES[0], payload(7))
    _corrupt(store, HASHES[0])
    with caplog.at_level("WARNING", logger="deepinfer.kvstore"):
        assert store.get(HASHES[0]) is None
    assert "checksum" in caplog.text
    st = store.stats()
    assert (st.num_corrupt, st.num_misses, st.num_hits) == (1, 1, 0)
    assert not store.contains(HASHES[0])
    store.put(HASHES[0], payload(7))  # recomputed and written again
    assert store.get(HASHES[0]) == payload(7)


def test_blocks_of_another_salt_or_layout_are_never_used(tmp_path):
    a = FsKVBlockStore(SALT, tmp_path, layout="L1")
    a.put(HASHES[0], payload(1))
    other_salt = salt_hash("another model")
    b = FsKVBlockStore(other_salt, tmp_path, layout="L1")
    assert b.get(HASHES[0]) is None and b.longest_prefix(HASHES) == 0  # separate namespace
    # Even a block copied into the wrong namespace is rejected by its header.
    b.block_path(HASHES[0]).parent.mkdir(parents=True)
    b.block_path(HASHES[0]).write_bytes(a.block_path(HASHES[0]).read_bytes())
    assert b.get(HASHES[0]) is None and b.stats().num_corrupt == 1
    c = FsKVBlockStore(SALT, tmp_path, layout="L2")
    assert c.get(HASHES[0]) is None and c.stats().num_corrupt == 1


def test_fs_evicts_least_recently_used_under_capacity(tmp_path):
    clock = FakeClock()
    block_bytes = HEADER_LEN + 1000
    s = FsKVBlockStore(SALT, tmp_path, capacity_bytes=int(4.5 * block_bytes), clock=clock,
                       low_watermark=0.8)
    for i in range(4):
        clock.t += 1
        s.put(HASHES[i], payload(i))
    clock.t += 1
    assert s.get(HASHES[0]) == payload(0)  # block 0 is now the most recently used
    clock.t += 1
    s.put(HASHES[4], payload(4))  # 5 blocks > 4.5: evict down to 0.8 * 4.5 = 3.6 blocks
    present = [i for i in range(5) if s.contains(HASHES[i])]
    assert present == [0, 3, 4]
    assert s.num_bytes() <= 4.5 * block_bytes and s.stats().num_evicted == 2
    for i in range(5, 10):
        s.put(HASHES[i], payload(i))
        assert s.num_bytes() <= 4.5 * block_bytes


def test_fs_eviction_sees_other_writers_after_a_rescan(tmp_path):
    block_bytes = HEADER_LEN + 1000
    cap = 6 * block_bytes
    a = FsKVBlockStore(SALT, tmp_path, capacity_bytes=cap, rescan_fraction=0.3)
    b = FsKVBlockStore(SALT, tmp_path, capacity_bytes=cap, rescan_fraction=0.3)
    for i in range(10):
        (a if i % 2 else b).put(HASHES[i], payload(i))
    # Each store rescans after 0.3 * cap of its own writes, so the overshoot stays bounded.
    assert a.num_bytes() <= cap + 2 * block_bytes


def test_fs_ignores_and_cleans_temp_files(tmp_path):
    clock = FakeClock()
    s = FsKVBlockStore(SALT, tmp_path, capacity_bytes=10**6, clock=clock)
    s.put(HASHES[0], payload(0))
    shard = s.block_path(HASHES[0]).parent
    stale = shard / ".half-written.123.abcd.tmp"
    stale.write_bytes(b"half")
    os.utime(stale, (clock.t - 7200, clock.t - 7200))
    fresh = shard / ".in-progress.456.abcd.tmp"
    fresh.write_bytes(b"half")
    assert [p for _, _, p in s.scan()] == [s.block_path(HASHES[0])]
    assert not stale.exists() and fresh.exists()


def test_fs_backend_failures_are_misses_not_crashes(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    s = FsKVBlockStore(SALT, blocker)
    s.put(HASHES[0], payload(0))  # cannot create the directory: logged, counted, skipped
    assert s.get(HASHES[0]) is None
    st = s.stats()
    assert st.num_errors >= 1 and st.num_puts == 0 and st.num_misses == 1


def test_default_root_follows_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_store_root() == tmp_path / "deepinfer" / "kvstore"
    s = open_store(None, SALT)
    assert s.directory == tmp_path / "deepinfer" / "kvstore" / SALT.hex()
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_store_root() == Path.home() / ".cache" / "deepinfer" / "kvstore"


def test_memory_store_is_lru_bounded():
    s = MemoryKVBlockStore(SALT, capacity_bytes=3 * (HEADER_LEN + 1000))
    for i in range(3):
        s.put(HASHES[i], payload(i))
    s.get(HASHES[0])
    s.put(HASHES[3], payload(3))
    assert [s.contains(h) for h in HASHES[:4]] == [True, False, True, True]
    assert s.num_bytes <= 3 * (HEADER_LEN + 1000) and s.stats().num_evicted == 1


def test_factory_urls(tmp_path):
    assert isinstance(open_store(f"fs://{tmp_path}", SALT), FsKVBlockStore)
    assert open_store(str(tmp_path), SALT).directory == tmp_path / SALT.hex()
    assert isinstance(open_store("memory", SALT), MemoryKVBlockStore)
    r = open_store("redis://127.0.0.1:1/0?ttl_s=60", SALT)  # does not connect yet
    assert r.ttl_s == 60 and r.url == "redis://127.0.0.1:1/0"
    for bad, msg in [("s3://bucket", "unknown KV store"), ("fs://relative/dir", "absolute"),
                     ("redis://h:1?ttl_s=abc", "integer"), ("redis://h:1?maxmem=1", "unknown redis")]:
        with pytest.raises(ValueError, match=msg):
            open_store(bad, SALT)
    with pytest.raises(ValueError, match="salt"):
        open_store("memory", b"short")


def test_fs_store_is_bounded_by_default_and_takes_a_capacity_option(tmp_path):
    assert open_store("fs", SALT).capacity_bytes == DEFAULT_FS_CAPACITY_BYTES
    assert open_store(str(tmp_path), SALT).capacity_bytes == DEFAULT_FS_CAPACITY_BYTES
    assert open_store(f"fs://{tmp_path}?capacity_bytes=5000", SALT).capacity_bytes == 5000
    assert open_store(f"{tmp_path}?capacity_bytes=7", SALT).directory == tmp_path / SALT.hex()
    assert open_store(str(tmp_path), SALT, capacity_bytes=9).capacity_bytes == 9
    assert open_store("memory", SALT).capacity_bytes is None
    assert open_store("memory?capacity_bytes=100", SALT).capacity_bytes == 100
    url = with_capacity("fs", 2**30)
    assert url == "fs?capacity_bytes=1073741824"
    assert open_store(url, SALT).capacity_bytes == 2**30
    assert open_store(with_capacity("fs:///x?", 3), SALT).capacity_bytes == 3
    for bad, msg in [(f"{tmp_path}?capacity_bytes=0", "positive"),
                     (f"{tmp_path}?capacity_bytes=1GiB", "integer"),
                     (f"{tmp_path}?ttl_s=5", "unknown fs/memory store option")]:
        with pytest.raises(ValueError, match=msg):
            open_store(bad, SALT)
    with pytest.raises(ValueError, match="given twice"):
        open_store("memory?capacity_bytes=100", SALT, capacity_bytes=5)
    with pytest.raises(ValueError, match="maxmemory"):
        with_capacity("redis://h:1/0", 100)
    with pytest.raises(ValueError, match="maxmemory"):
        open_store("redis://h:1/0", SALT, capacity_bytes=100)
    with pytest.raises(ValueError, match="already sets"):
        with_capacity("fs?capacity_bytes=5", 100)


def test_fs_capacity_bounds_every_salt_under_the_root_together(tmp_path):
    """The default root is the user's cache, shared by every model served on the machine:
    blocks of a salt nobody uses any more are evicted too (least recently used first)."""
    clock = FakeClock()
    block_bytes = HEADER_LEN + 1000
    cap = int(6.5 * block_bytes)
    old = FsKVBlockStore(salt_hash("retired model"), tmp_path, capacity_bytes=cap, clock=clock)
    for i in range(6):
        clock.t += 1
        old.put(HASHES[i], payload(i))
    (tmp_path / "not-a-store").mkdir()
    (tmp_path / "not-a-store" / "keep.kvb").write_bytes(b"x" * 10 * block_bytes)
    new = FsKVBlockStore(SALT, tmp_path, capacity_bytes=cap, clock=clock)
    for i in range(6):
        clock.t += 1
        new.put(HASHES[i], payload(i))
        assert new.num_bytes() <= cap
    assert all(new.contains(h) for h in HASHES[:6])
    assert not any(old.contains(h) for h in HASHES[:6])
    assert (tmp_path / "not-a-store" / "keep.kvb").exists()  # only salt dirs are touched


def test_writer_writes_through_without_blocking(tmp_path):
    store = FsKVBlockStore(SALT, tmp_path)
    writer = KVStoreWriter(store, max_pending_blocks=64)
    for i, h in enumerate(HASHES):
        assert writer.submit(h, payload(i))
    assert writer.flush(timeout_s=10)
    assert store.longest_prefix(HASHES) == len(HASHES)
    assert [store.get(h) for h in HASHES] == [payload(i) for i in range(len(HASHES))]
    st = writer.stats()
    assert (st.num_submitted, st.num_written, st.num_dropped, st.num_pending) == (10, 10, 0, 0)
    assert writer.close(timeout_s=5)
    assert not writer.submit(HASHES[0], payload(0))  # closed: dropped


class SlowStore(MemoryKVBlockStore):
    def __init__(self) -> None:
        super().__init__(SALT)
        self.release = threading.Event()

    def _write(self, block_hash: bytes, data: bytes) -> None:
        self.release.wait(10)
        super()._write(block_hash, data)


def test_writer_drops_instead_of_blocking_when_the_store_is_slow():
    store = SlowStore()
    writer = KVStoreWriter(store, max_pending_blocks=2)
    accepted = [writer.submit(h, payload(i)) for i, h in enumerate(HASHES)]
    assert accepted.count(True) in (2, 3)  # queue bound + possibly one in progress
    assert writer.submit(HASHES[0], payload(0))  # already pending: not queued twice
    assert not writer.flush(timeout_s=0.05)
    store.release.set()
    assert writer.close(timeout_s=5)
    st = writer.stats()
    assert st.num_dropped == len(HASHES) - st.num_submitted and st.num_written == st.num_submitted


def test_store_imports_neither_torch_nor_redis_unless_asked():
    import subprocess
    import sys
    code = ("import sys; sys.modules['torch'] = None; sys.modules['redis'] = None\n"
            "import deepinfer.kvstore as k, deepinfer.kvstore.fs_store, deepinfer.kvstore.memory_store\n"
            "k.open_store('memory', b'0' * 16)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)
