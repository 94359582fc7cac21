"""Store reads off the engine loop (`KVPrefetcher`) and the host-memory tier
(`TieredKVBlockStore`, `host_cache_bytes`)."""
from __future__ import annotations

import threading
import time

import pytest

from deepinfer.core.prefix_hash import salt_hash
from deepinfer.kvstore import open_store
from deepinfer.kvstore.factory import with_capacity, with_host_cache
from deepinfer.kvstore.memory_store import MemoryKVBlockStore
from deepinfer.kvstore.prefetcher import KVPrefetcher, PrefetchJob
from deepinfer.kvstore.tiered_store import (HOST_TIER, SHARED_TIER, TieredKVBlockStore,
                                            fetch_with_tier)

SALT = salt_hash("test-salt")
H = [bytes([i]) * 16 for i in range(8)]


def wait_done(prefetcher: KVPrefetcher, n: int, timeout: float = 10.0) -> list[PrefetchJob]:
    done: list[PrefetchJob] = []
    deadline = time.monotonic() + timeout
    while len(done) < n:
        assert time.monotonic() < deadline, "prefetch jobs did not finish"
        done += prefetcher.poll()
        time.sleep(0.002)
    return done


def test_prefetch_reads_leading_hits_and_stops_at_the_first_miss():
    store = MemoryKVBlockStore(SALT)
    for h in (H[0], H[1], H[3]):
        store.put(h, h * 4)
    prefetcher = KVPrefetcher(lambda h: fetch_with_tier(store, h), store.contains)
    job = PrefetchJob("r", H[:5], deadline=time.monotonic() + 30)
    prefetcher.submit(job)
    [got] = wait_done(prefetcher, 1)
    assert got is job and job.payloads == [H[0] * 4, H[1] * 4]  # H[2] missing: stop there
    assert job.tiers == [SHARED_TIER, SHARED_TIER] and job.num_bytes == 128
    prefetcher.close()


def test_prefetch_awaits_blocks_being_published_until_its_deadline():
    store = MemoryKVBlockStore(SALT)
    prefetcher = KVPrefetcher(lambda h: fetch_with_tier(store, h), store.contains)
    waiting = PrefetchJob("w", H[:2], deadline=time.monotonic() + 30, num_await_blocks=2)
    prefetcher.submit(waiting)
    # A job that does not wait is not held up by the one that does.
    store.put(H[5], b"x" * 8)
    quick = PrefetchJob("q", [H[5]], deadline=time.monotonic() + 30)
    prefetcher.submit(quick)
    assert wait_done(prefetcher, 1) == [quick]
    assert not waiting.done
    store.put(H[0], b"a" * 8)  # another worker publishes, block by block
    store.put(H[1], b"b" * 8)
    assert wait_done(prefetcher, 1) == [waiting]
    assert waiting.payloads == [b"a" * 8, b"b" * 8] and waiting.waited_s > 0
    # Past its deadline a job gives up on a block that never comes.
    late = PrefetchJob("l", [H[6]], deadline=time.monotonic() + 0.05, num_await_blocks=1)
    prefetcher.submit(late)
    assert wait_done(prefetcher, 1) == [late] and late.payloads == []
    prefetcher.close()


def test_prefetch_cancel_and_close():
    gate = threading.Event()
    store = MemoryKVBlockStore(SALT)

    def slow_fetch(h):
        gate.wait(5)
        return fetch_with_tier(store, h)
    prefetcher = KVPrefetcher(slow_fetch, store.contains, num_threads=1)
    first = PrefetchJob("a", [H[0]], deadline=time.monotonic() + 30)
    second = PrefetchJob("b", [H[1]], deadline=time.monotonic() + 30)
    prefetcher.submit(first)
    prefetcher.submit(second)
    prefetcher.cancel("b")
    gate.set()
    done = wait_done(prefetcher, 2)
    assert {j.request_id for j in done} == {"a", "b"} and second.cancelled
    prefetcher.close()
    closed = PrefetchJob("c", [H[2]], deadline=time.monotonic() + 30)
    prefetcher.submit(closed)
    assert closed.done and prefetcher.poll() == [closed]
    with pytest.raises(ValueError):
        KVPrefetcher(slow_fetch, store.contains, num_threads=0)


def test_host_tier_serves_recent_blocks_and_is_bounded():
    lower = MemoryKVBlockStore(SALT)
    tiered = TieredKVBlockStore(lower, host_capacity_bytes=3 * 200)
    lower.put(H[0], b"0" * 100)  # written by another worker: only in the shared store
    assert tiered.fetch(H[0]) == (b"0" * 100, SHARED_TIER)
    assert tiered.fetch(H[0]) == (b"0" * 100, HOST_TIER)  # copied up on the first read
    for h in H[1:6]:
        tiered.put(h, h * 8)
    assert lower.contains(H[5]) and tiered.host.num_bytes <= 600
    assert not tiered.host.contains(H[1])  # least recently used left the host tier
    assert tiered.fetch(H[1]) == (H[1] * 8, SHARED_TIER)
    assert tiered.fetch(H[7]) == (None, None)
    assert tiered.longest_prefix([H[0], H[1], H[7]]) == 2
    assert tiered.stats() == lower.stats()
    with pytest.raises(ValueError):
        TieredKVBlockStore(lower, 0)


def test_host_cache_url_option(tmp_path):
    url = with_host_cache(with_capacity(f"fs://{tmp_path}", 1 << 20), 4096)
    assert url == f"fs://{tmp_path}?capacity_bytes=1048576&host_cache_bytes=4096"
    store = open_store(url, SALT)
    assert isinstance(store, TieredKVBlockStore) and store.host.capacity_bytes == 4096
    assert store.lower.capacity_bytes == 1 << 20
    store.put(H[0], b"z" * 10)
    assert store.fetch(H[0]) == (b"z" * 10, HOST_TIER)
    store.close()
    assert with_host_cache("redis://127.0.0.1:1/0?ttl_s=5", 10).endswith("&host_cache_bytes=10")
    for bad in (lambda: with_host_cache("memory", 10), lambda: with_host_cache("fs", 0),
                lambda: open_store("memory?host_cache_bytes=10", SALT),
                lambda: open_store(f"fs://{tmp_path}?host_cache_bytes=0", SALT),
                lambda: with_host_cache(url, 5)):
        with pytest.raises(ValueError):
            bad()
