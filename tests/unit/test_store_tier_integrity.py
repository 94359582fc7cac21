"""Every store tier checks a block's checksum on every read (blocks written
by a worker that crashed mid-write, or flipped at rest). The host-memory tier in front of a
shared store is a checked store too: a bad copy there is a counted miss and the shared
store's good copy is served (and copied up again); a torn file in the fs store is a miss."""
from __future__ import annotations

from deepinfer.core.prefix_hash import salt_hash
from deepinfer.kvstore.fs_store import FsKVBlockStore
from deepinfer.kvstore.memory_store import MemoryKVBlockStore
from deepinfer.kvstore.tiered_store import HOST_TIER, SHARED_TIER, TieredKVBlockStore

SALT = salt_hash("integrity")
H = [bytes([i]) * 16 for i in range(4)]


def _flip_host_copy(tiered: TieredKVBlockStore, block_hash: bytes) -> None:
    data = bytearray(tiered.host._blocks[block_hash])
    data[-1] ^= 0xFF
    tiered.host._blocks[block_hash] = bytes(data)


def test_a_corrupt_host_tier_copy_is_a_miss_and_the_shared_copy_is_served(tmp_path):
    lower = FsKVBlockStore(SALT, tmp_path, layout="L")
    tiered = TieredKVBlockStore(lower, host_capacity_bytes=1 << 20)
    tiered.put(H[0], b"good" * 64)
    _flip_host_copy(tiered, H[0])
    assert tiered.fetch(H[0]) == (b"good" * 64, SHARED_TIER)
    assert tiered.host.stats().num_corrupt == 1
    assert tiered.fetch(H[0]) == (b"good" * 64, HOST_TIER)  # the good copy was copied up


def test_a_torn_block_file_is_a_miss_on_every_tier(tmp_path):
    lower = FsKVBlockStore(SALT, tmp_path, layout="L")
    lower.put(H[1], b"kv" * 512)
    path = lower.block_path(H[1])
    path.write_bytes(path.read_bytes()[:100])  # a writer that died mid-block
    tiered = TieredKVBlockStore(lower, host_capacity_bytes=1 << 20)
    assert tiered.fetch(H[1]) == (None, None)
    assert lower.stats().num_corrupt == 1 and not path.exists()
    assert not tiered.host.contains(H[1])  # nothing bad was copied up


def test_a_memory_store_checks_its_blocks_too():
    store = MemoryKVBlockStore(SALT, layout="L")
    store.put(H[2], b"x" * 100)
    data = bytearray(store._blocks[H[2]])
    data[60] ^= 0x01
    store._blocks[H[2]] = bytes(data)
    assert store.get(H[2]) is None and store.stats().num_corrupt == 1
