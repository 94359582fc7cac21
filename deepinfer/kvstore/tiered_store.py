"""`TieredKVBlockStore`: a bounded host-memory tier in front of a shared store (fs, Redis).

    get:  host memory ─miss─▶ shared store ─hit─▶ copied into host memory (LRU)
    put:  host memory and shared store (write-through)

Recently used blocks are served from this process's DRAM without a file read or a network
round trip; the shared store stays the tier every worker can read. `fetch` says which tier
answered (for hits-by-tier metrics). Same interface as `KVBlockStore` where callers use it.
"""
from __future__ import annotations

from collections.abc import Sequence

from deepinfer.kvstore.base import KVBlockStore, KVStoreStats
from deepinfer.kvstore.memory_store import MemoryKVBlockStore

HOST_TIER = "host"
SHARED_TIER = "shared"


class TieredKVBlockStore:
    def __init__(self, lower: KVBlockStore, host_capacity_bytes: int) -> None:
        if host_capacity_bytes < 1:
            raise ValueError(f"host cache capacity must be positive, got {host_capacity_bytes}")
        self.lower = lower
        self.host = MemoryKVBlockStore(lower.salt, lower.layout, host_capacity_bytes)
        self.backend = f"host+{lower.backend}"
        self.salt, self.layout = lower.salt, lower.layout

    def fetch(self, block_hash: bytes) -> tuple[bytes | None, str | None]:
        """(payload, tier that had it) or (None, None) on a miss in both."""
        payload = self.host.get(block_hash)
        if payload is not None:
            return payload, HOST_TIER
        payload = self.lower.get(block_hash)
        if payload is None:
            return None, None
        self.host.put(block_hash, payload)
        return payload, SHARED_TIER

    def get(self, block_hash: bytes) -> bytes | None:
        return self.fetch(block_hash)[0]

    def put(self, block_hash: bytes, payload: bytes | memoryview) -> None:
        self.host.put(block_hash, payload)
        self.lower.put(block_hash, payload)

    def contains(self, block_hash: bytes) -> bool:
        return self.host.contains(block_hash) or self.lower.contains(block_hash)

    def longest_prefix(self, hashes: Sequence[bytes]) -> int:
        for i, block_hash in enumerate(hashes):
            if not self.contains(block_hash):
                return i
        return len(hashes)

    def stats(self) -> KVStoreStats:
        """The shared store's statistics (what crossed to fs / Redis); `host.stats()` has the
        host tier's."""
        return self.lower.stats()

    def close(self) -> None:
        self.host.close()
        self.lower.close()


def fetch_with_tier(store, block_hash: bytes) -> tuple[bytes | None, str | None]:
    """`store.fetch` for a tiered store; a plain store's hit is a shared-tier hit."""
    if isinstance(store, TieredKVBlockStore):
        return store.fetch(block_hash)
    payload = store.get(block_hash)
    return payload, (SHARED_TIER if payload is not None else None)
