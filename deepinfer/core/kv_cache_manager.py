"""Per-request block tables over a BlockPool, with prefix-cache lookups. Pure.

Contract: `allocate_slots` either grows a request's table to hold `num_computed_tokens +
num_new_tokens` tokens and returns True, or changes nothing and returns False. Full blocks are
registered in the prefix cache as soon as they are allocated for tokens being computed: the
runner writes every layer's new KV before any attention reads it, so a block scheduled in the
same step by another request is already valid when read.

Speculative decoding: `num_lookahead_tokens` slots past the computed tokens are allocated too
(a drafter writes its KV there) but never registered, and only blocks full of a request's
known (accepted) tokens are ever hashed; `trim` frees blocks past the accepted tokens.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from deepinfer.core.block_pool import BlockPool, KVBlock
from deepinfer.core.prefix_hash import ROOT_HASH, BlockHash, block_extra_keys, hash_block_tokens
from deepinfer.core.request import Request


@dataclass(frozen=True)
class PrefixHit:
    """Blocks found in the device cache for a request's prompt, not yet referenced."""

    blocks: list[KVBlock]
    num_tokens: int


@dataclass(frozen=True)
class TierLoad:
    """What `load_prefix_blocks` found: leading blocks already cached here, then loaded."""

    num_device_blocks: int
    num_loaded_blocks: int


Payload = TypeVar("Payload")


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_salt: BlockHash = ROOT_HASH) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_salt = hash_salt
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self._num_hashed_blocks: dict[str, int] = {}  # blocks of the table registered in the cache
        # Prefix-cache counters in tokens (vLLM's prefix_cache_queries / hits).
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def update_block_hashes(self, request: Request) -> None:
        """Extend `request.block_hashes` to cover every full block of its known tokens."""
        hashes = request.block_hashes
        num_full = request.num_tokens // self.block_size
        parent = hashes[-1] if hashes else self.hash_salt
        for i in range(len(hashes), num_full):
            start, end = i * self.block_size, (i + 1) * self.block_size
            extra = block_extra_keys(start, end, request.mm_placeholders,
                                     request.sampling_params.cache_salt)
            parent = hash_block_tokens(parent, request.all_token_ids[start:end], extra)
            hashes.append(parent)

    def find_prefix(self, request: Request) -> PrefixHit:
        """Longest cached prefix of the request's full blocks; at least one token is left to
        compute so the step produces logits. Nothing for a request that needs its prompt
        log-probs (every position must be computed)."""
        if not self.enable_prefix_caching or request.needs_prompt_logprobs:
            return PrefixHit([], 0)
        self.update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return PrefixHit(blocks, len(blocks) * self.block_size)

    def load_prefix_blocks(self, block_hashes: Sequence[BlockHash],
                           fetch: Callable[[BlockHash], Payload | None],
                           write: Callable[[int, Payload], None]) -> TierLoad:
        """Extend the device prefix cache with blocks from a lower tier (the shared store).

        The leading blocks of `block_hashes` already cached here are referenced first, so the
        allocations for loaded blocks can never evict the prompt's own head. Then, block by
        block: `fetch(hash)` returns the payload or None (a miss ends the load), and
        `write(block_id, payload)` puts it into the fresh device block, which is registered
        under its hash. At most half the free blocks are used (the rest stay for compute).
        Every block is released at the end, cached-free with the chain's tail evicted first,
        so the scheduler's `find_prefix` finds the whole run as if computed here.
        """
        if not self.enable_prefix_caching:
            return TierLoad(0, 0)
        held: list[KVBlock] = []
        for block_hash in block_hashes:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            held.append(block)
        self.pool.touch(held)
        num_device = len(held)
        budget = self.pool.num_free_blocks // 2
        num_loaded = 0
        try:
            for block_hash in block_hashes[num_device:]:
                block = self.pool.get_cached_block(block_hash)
                if block is not None:  # behind a gap in the chain: already here
                    self.pool.touch([block])
                    held.append(block)
                    continue
                if num_loaded == budget:
                    break
                payload = fetch(block_hash)
                if payload is None:
                    break  # absent, evicted or corrupt: compute from here on
                [block] = self.pool.allocate(1)
                held.append(block)  # released (uncached if the write fails) below
                write(block.block_id, payload)
                self.pool.cache_block(block, block_hash)
                num_loaded += 1
        finally:
            self.pool.free(reversed(held))
        return TierLoad(num_device, num_loaded)

    def record_prefix_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.num_prefix_queries += num_query_tokens
        self.num_prefix_hits += num_hit_tokens

    def num_blocks_needed(self, request: Request, num_new_tokens: int,
                          hit: PrefixHit | None = None, num_lookahead_tokens: int = 0) -> int:
        """New blocks `allocate_slots` would pop from the free queue (cache-hit blocks that
        sit in the free queue count too, since referencing them removes them)."""
        have = len(self.req_blocks.get(request.request_id, ()))
        computed = request.num_computed_tokens
        reuse_free = 0
        if hit is not None and hit.blocks:
            have += len(hit.blocks)
            computed = hit.num_tokens
            reuse_free = sum(1 for b in hit.blocks if b.ref_cnt == 0)
        total = -(-(computed + num_new_tokens + num_lookahead_tokens) // self.block_size)
        return max(0, total - have) + reuse_free

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       hit: PrefixHit | None = None, cache_blocks: bool = True,
                       num_lookahead_tokens: int = 0) -> bool:
        """`cache_blocks=False` registers no block in the prefix cache (KV that arrives later
        over a transfer must not be found by another request before it is written).
        `num_lookahead_tokens`: extra slots after the new tokens, never registered."""
        if self.num_blocks_needed(request, num_new_tokens, hit,
                                  num_lookahead_tokens) > self.pool.num_free_blocks:
            return False
        table = self.req_blocks.setdefault(request.request_id, [])
        self._num_hashed_blocks.setdefault(request.request_id, 0)
        if hit is not None and hit.blocks:
            assert not table, "a prefix hit only applies to a request without blocks"
            self.pool.touch(hit.blocks)
            table.extend(hit.blocks)
            self._num_hashed_blocks[request.request_id] = len(hit.blocks)
            computed = hit.num_tokens
        else:
            computed = request.num_computed_tokens
        total = -(-(computed + num_new_tokens + num_lookahead_tokens) // self.block_size)
        if total > len(table):
            table.extend(self.pool.allocate(total - len(table)))
        if cache_blocks:
            self._cache_full_blocks(request, computed + num_new_tokens)
        return True

    def cache_computed_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's full blocks up to `num_tokens` once their KV is valid."""
        self._cache_full_blocks(request, num_tokens)

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        if not self.enable_prefix_caching:
            return
        self.update_block_hashes(request)
        table = self.req_blocks[request.request_id]
        start = self._num_hashed_blocks[request.request_id]
        end = min(num_tokens // self.block_size, len(request.block_hashes))
        for i in range(start, end):
            self.pool.cache_block(table[i], request.block_hashes[i])
        self._num_hashed_blocks[request.request_id] = max(start, end)

    def uncache_uncomputed_blocks(self, request: Request) -> None:
        """Take the request's blocks past its computed tokens out of the prefix cache: they
        were registered when scheduled, and a step that failed part-way left them partial."""
        table = self.req_blocks.get(request.request_id)
        if not table:
            return
        first = request.num_computed_tokens // self.block_size
        for block in table[first:]:
            self.pool.uncache_block(block)
        self._num_hashed_blocks[request.request_id] = min(
            self._num_hashed_blocks.get(request.request_id, 0), first)

    def trim(self, request: Request, num_tokens: int) -> int:
        """Free the request's blocks past its first `num_tokens` slots (they held rejected
        draft tokens or lookahead KV, and were never registered); returns how many."""
        table = self.req_blocks.get(request.request_id)
        if not table:
            return 0
        keep = -(-num_tokens // self.block_size)
        if keep >= len(table):
            return 0
        assert keep >= self._num_hashed_blocks[request.request_id], "trimming a cached block"
        extra = table[keep:]
        del table[keep:]
        self.pool.free(reversed(extra))
        return len(extra)

    def free(self, request: Request) -> None:
        table = self.req_blocks.pop(request.request_id, None)
        self._num_hashed_blocks.pop(request.request_id, None)
        if table:
            # Tail blocks are the least likely to be shared: evict them first.
            self.pool.free(reversed(table))

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        refs: dict[int, int] = {}
        for table in self.req_blocks.values():
            for block in table:
                refs[block.block_id] = refs.get(block.block_id, 0) + 1
        for block in self.pool.blocks:
            assert block.ref_cnt == refs.get(block.block_id, 0), \
                f"block {block.block_id}: ref_cnt {block.ref_cnt}, tables hold {refs.get(block.block_id, 0)}"
