"""The shared prefix store as the simulator sees it: which block hashes it holds. Pure.

An LRU set of chained block hashes with an optional capacity in blocks; a read refreshes a
block. Payloads are not modelled, only their transfer time (`StoreSpec.link`).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class SimPrefixStore:
    def __init__(self, capacity_blocks: int | None = None) -> None:
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[bytes, None] = OrderedDict()
        self.num_reads = 0
        self.num_writes = 0
        self.num_evictions = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def get(self, block_hash: bytes) -> bool | None:
        """True when present (refreshed), None when absent (the KVCacheManager's fetch shape)."""
        if block_hash not in self._blocks:
            return None
        self._blocks.move_to_end(block_hash)
        self.num_reads += 1
        return True

    def contains(self, block_hash: bytes) -> bool:
        """Present, without counting a read or refreshing it (a waiter polling the store)."""
        return block_hash in self._blocks

    def put_many(self, block_hashes: Iterable[bytes]) -> int:
        """Store blocks (a background write that completed); returns how many were new."""
        num_new = 0
        for block_hash in block_hashes:
            if block_hash in self._blocks:
                self._blocks.move_to_end(block_hash)
                continue
            self._blocks[block_hash] = None
            num_new += 1
            self.num_writes += 1
            if self.capacity_blocks is not None and len(self._blocks) > self.capacity_blocks:
                self._blocks.popitem(last=False)
                self.num_evictions += 1
        return num_new
