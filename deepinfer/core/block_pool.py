"""KV blocks, reference counts, the free (LRU eviction) queue and the hash → block map. Pure.

A block is in exactly one of three states:
  in use      ref_cnt > 0, not in the free queue (may also be cached by hash)
  cached-free ref_cnt == 0, in the free queue, still findable by hash (evictable)
  free        ref_cnt == 0, in the free queue, no hash
Allocation pops from the front of the free queue (least recently freed first) and evicts the
block's hash, so unreferenced cached blocks are reused in LRU order.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from deepinfer.core.prefix_hash import BlockHash


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # block_id -> None, ordered front (evict first) to back (most recently freed).
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockHash, int] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        block_id = self._cached.get(block_hash)
        return None if block_id is None else self.blocks[block_id]

    def is_cached(self, block_hash: BlockHash) -> bool:
        return block_hash in self._cached

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on blocks found in the cache (removing free ones from the queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        """Pop `num_blocks` blocks with ref_cnt 1. Caller checks `num_free_blocks` first."""
        if num_blocks > len(self._free):
            raise RuntimeError(f"asked for {num_blocks} blocks, {len(self._free)} free")
        out = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            self._evict_hash(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; pass them in eviction order (first = evicted first)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed twice")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = None
                if block.block_hash is None or not self.enable_caching:
                    self._evict_hash(block)
                    # Uncached blocks go first in line: nothing can reuse their contents.
                    self._free.move_to_end(block.block_id, last=False)

    def cache_block(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Register a full, computed (or being computed this step) block under its hash."""
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash = block_hash
        # A concurrent duplicate keeps the first owner in the map; this one stays unlisted.
        self._cached.setdefault(block_hash, block.block_id)

    def uncache_block(self, block: KVBlock) -> None:
        """Forget `block`'s hash (its KV is not valid: e.g. a failed step left it partial)."""
        if block.block_hash is None:
            return
        if self._cached.get(block.block_hash) == block.block_id:
            del self._cached[block.block_hash]
        block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use."""
        if self.num_used_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
        return True

    def _evict_hash(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        if self._cached.get(block.block_hash) == block.block_id:
            del self._cached[block.block_hash]
            self.num_evictions += 1
        block.block_hash = None

    def check_invariants(self) -> None:
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"block {block.block_id} has negative ref count"
            assert (block.ref_cnt == 0) == (block.block_id in self._free), \
                f"block {block.block_id}: ref_cnt {block.ref_cnt} vs free-queue membership"
        for block_hash, block_id in self._cached.items():
            assert self.blocks[block_id].block_hash == block_hash, "hash map points at a stale block"
