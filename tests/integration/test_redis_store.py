"""The Redis prefix store against a real redis-server started by this module."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from deepinfer.core.prefix_hash import hash_request_blocks, salt_hash
from deepinfer.kvstore import open_store
from deepinfer.kvstore.redis_store import RedisKVBlockStore
from tests.integration.redis_server import free_port, running_redis_server

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]
CHILD = str(Path(__file__).with_name("kvstore_child.py"))
SALT = salt_hash("SmolLM2-135M", "float32", "16", "test-layout")
HASHES = hash_request_blocks(list(range(160)), 16)


@pytest.fixture(scope="module")
def redis_url():
    with running_redis_server() as url:
        yield url


@pytest.fixture
def store(redis_url):
    redis.Redis.from_url(redis_url).flushdb()
    s = open_store(redis_url, SALT, layout="L")
    yield s
    s.close()


def test_put_get_and_pipelined_longest_prefix(store):
    for i in (0, 1, 2, 5):
        store.put(HASHES[i], bytes([i]) * 5000)
    assert store.get(HASHES[2]) == bytes([2]) * 5000 and store.get(HASHES[3]) is None
    assert store.longest_prefix(HASHES) == 3 and store.longest_prefix([]) == 0
    store.put(HASHES[0], b"ignored")
    st = store.stats()
    assert (st.num_hits, st.num_misses, st.num_puts, st.num_put_skipped) == (1, 1, 4, 1)


def test_corrupt_value_is_a_counted_deleted_miss(store):
    store.put(HASHES[0], b"x" * 100)
    raw = redis.Redis.from_url(store.url)
    value = bytearray(raw.get(store.key(HASHES[0])))
    value[-1] ^= 1
    raw.set(store.key(HASHES[0]), bytes(value))
    assert store.get(HASHES[0]) is None
    assert store.stats().num_corrupt == 1 and raw.exists(store.key(HASHES[0])) == 0


def test_salts_are_separate_namespaces(store, redis_url):
    store.put(HASHES[0], b"a")
    other = open_store(redis_url, salt_hash("another model"), layout="L")
    assert other.get(HASHES[0]) is None and other.longest_prefix(HASHES) == 0


def test_ttl_is_renewed_by_reads(redis_url):
    raw = redis.Redis.from_url(redis_url)
    raw.flushdb()
    s = open_store(f"{redis_url}?ttl_s=100", SALT)
    s.put(HASHES[0], b"a")
    assert 90 < raw.ttl(s.key(HASHES[0])) <= 100
    raw.expire(s.key(HASHES[0]), 5)
    assert s.get(HASHES[0]) == b"a"
    assert raw.ttl(s.key(HASHES[0])) > 50


def test_blocks_written_by_one_process_are_read_by_another(redis_url):
    redis.Redis.from_url(redis_url).flushdb()
    outs = []
    for mode, seed in (("write", 1), ("read", 2)):
        out = subprocess.run([sys.executable, CHILD, mode, redis_url], capture_output=True,
                             text=True, timeout=30, check=True,
                             env={**os.environ, "PYTHONHASHSEED": str(seed),
                                  # one deployment: the values are signed with its secret
                                  "DEEPINFER_CLUSTER_SECRET": "redis-test-" + "s" * 16})
        outs.append(json.loads(out.stdout))
    written, read = outs
    assert written["hashes"] == read["hashes"] and written["str_hash"] != read["str_hash"]
    assert read["stats"]["num_hits"] == 12 and read["bad_payloads"] == 0


@pytest.fixture
def silent_server():
    """A port that accepts connections (the kernel's backlog) and never answers: without
    socket timeouts every command would wait forever (the module's timeout fails the test)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield f"redis://127.0.0.1:{listener.getsockname()[1]}/0"


@pytest.mark.parametrize("server", ["refused", "silent"])
def test_unreachable_or_silent_server_is_a_counted_miss_not_an_error(server, silent_server):
    url = silent_server if server == "silent" else f"redis://127.0.0.1:{free_port()}/0"
    s = RedisKVBlockStore(url, SALT, socket_timeout_s=0.2)
    assert s.get(HASHES[0]) is None
    assert s.longest_prefix(HASHES) == 0
    s.put(HASHES[0], b"a")  # skipped, not raised
    assert not s.contains(HASHES[0])
    st = s.stats()
    assert st.num_errors == 4 and st.num_misses == 1 and st.num_puts == 0
    s.close()


def test_a_tenants_published_prefix_is_found_in_redis_only_with_its_salt(redis_url):
    """cache_salt keys the Redis store as it keys the device cache: tenant A's prompt,
    published through one worker's tier, is missed by an unsalted request and by tenant B on
    another worker's tier, and loaded there (bit-exact) for tenant A."""
    import torch

    from deepinfer.cluster.prefix_store_tier import SharedPrefixTier, layout_for_cache
    from deepinfer.core.kv_cache_manager import KVCacheManager
    from deepinfer.runtime.kv_cache import KVCacheSpec, PagedKVCache

    block, prompt = 2, list(range(100, 109))  # 4 full blocks, one token left to compute
    raw = redis.Redis.from_url(redis_url)
    raw.flushdb()

    def tier() -> SharedPrefixTier:
        cache = PagedKVCache(KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=4,
                                         block_size=block, dtype=torch.float32),
                             8, torch.device("cpu"))
        layout = layout_for_cache(cache)
        return SharedPrefixTier(open_store(redis_url, SALT, layout=layout.descriptor), cache,
                                KVCacheManager(8, block), layout)

    writer, reader = tier(), tier()
    kv = torch.arange(4 * 2 * 2 * block * 4, dtype=torch.float32).reshape(2, 2, 4, block, 1, 4)
    assert writer.write_through(prompt, kv, cache_salt="tenant-a") == 4
    assert writer.writer.flush(timeout_s=10)
    salted = writer.block_hashes(prompt, cache_salt="tenant-a")
    assert all(raw.exists(writer.store.key(h)) for h in salted)
    assert len(raw.keys("deepinfer:kv:*")) == 4  # nothing stored under another key
    for salt in (None, "tenant-b"):
        assert reader.load_prefix(prompt, cache_salt=salt).num_store_blocks == 0, salt
        assert reader.store.longest_prefix(reader.block_hashes(prompt, cache_salt=salt)) == 0
    load = reader.load_prefix(prompt, cache_salt="tenant-a")
    assert (load.num_device_blocks, load.num_store_blocks) == (0, 4)
    ids = [reader.kv.pool.get_cached_block(h).block_id for h in salted]
    assert torch.equal(reader.cache.read_blocks(ids), kv)
    assert reader.store.stats().num_hits == 4
    writer.close()
    reader.close()
    raw.close()
