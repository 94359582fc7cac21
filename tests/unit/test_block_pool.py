"""BlockPool: ref counts, the free (LRU eviction) queue and the hash -> block map.

A hypothesis state machine drives allocate / touch / free / cache_block / reset against a model
that only tracks references held and when each block was last freed; the pool's own
`check_invariants()` runs after every operation.
"""
from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

from deepinfer.core.block_pool import BlockPool

HASHES = [bytes([i]) * 16 for i in range(1, 9)]  # a small set, so duplicates happen


class BlockPoolMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(1, 8), enable_caching=st.booleans())
    def setup(self, num_blocks, enable_caching):
        self.pool = BlockPool(num_blocks, enable_caching=enable_caching)
        self.held: list[int] = []  # one entry per reference we hold (block ids)
        self.clock = 0
        self.freed_at: dict[int, int] = {}  # block id -> clock when its ref count last hit 0
        self.hashed_when_freed: dict[int, bool] = {i: False for i in range(num_blocks)}

    # ---- helpers ---------------------------------------------------------------------------
    def refs(self, block_id: int) -> int:
        return self.held.count(block_id)

    def free_ids(self) -> list[int]:
        return [b.block_id for b in self.pool.blocks if b.ref_cnt == 0]

    def expect_pop_order_ok(self, popped: list[int], free_before: list[int]) -> None:
        """Unhashed free blocks go first; hashed ones leave least recently freed first."""
        unhashed = {i for i in free_before if not self.hashed_when_freed[i]}
        hashed = sorted((i for i in free_before if self.hashed_when_freed[i]),
                        key=lambda i: self.freed_at[i])
        k = len(popped)
        if k <= len(unhashed):
            assert set(popped) <= unhashed
        else:
            assert set(popped[:len(unhashed)]) == unhashed
            assert popped[len(unhashed):] == hashed[:k - len(unhashed)]

    # ---- rules -----------------------------------------------------------------------------
    @rule(data=st.data())
    def allocate(self, data):
        free_before = self.free_ids()
        k = data.draw(st.integers(0, len(free_before)), label="k")
        findable_before = {h: self.pool.get_cached_block(h).block_id
                           for h in HASHES if self.pool.is_cached(h)}
        evictions_before = self.pool.num_evictions
        blocks = self.pool.allocate(k)
        popped = [b.block_id for b in blocks]
        assert len(set(popped)) == k
        self.expect_pop_order_ok(popped, free_before)
        for b in blocks:
            assert b.ref_cnt == 1 and b.block_hash is None
            self.hashed_when_freed[b.block_id] = False
        evicted = {h for h, bid in findable_before.items() if bid in popped}
        assert self.pool.num_evictions - evictions_before == len(evicted)
        for h, bid in findable_before.items():
            assert self.pool.is_cached(h) == (h not in evicted)
        self.held.extend(popped)

    @rule(extra=st.integers(1, 3))
    def allocate_too_many_changes_nothing(self, extra):
        before = [(b.ref_cnt, b.block_hash) for b in self.pool.blocks]
        with pytest.raises(RuntimeError):
            self.pool.allocate(self.pool.num_free_blocks + extra)
        assert [(b.ref_cnt, b.block_hash) for b in self.pool.blocks] == before

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free_references(self, data):
        picks = data.draw(st.lists(st.sampled_from(sorted(set(self.held))), min_size=1,
                                   max_size=3, unique=True), label="picks")
        for block_id in picks:
            self.held.remove(block_id)
        self.pool.free(self.pool.blocks[i] for i in picks)
        for block_id in picks:
            if self.refs(block_id) == 0:
                self.clock += 1
                self.freed_at[block_id] = self.clock
                self.hashed_when_freed[block_id] = self.pool.blocks[block_id].block_hash is not None
                if not self.pool.enable_caching:
                    assert self.pool.blocks[block_id].block_hash is None

    @precondition(lambda self: self.held)
    @rule(data=st.data(), block_hash=st.sampled_from(HASHES))
    def cache_block(self, data, block_hash):
        block = self.pool.blocks[data.draw(st.sampled_from(self.held), label="block")]
        old_hash = block.block_hash
        owner_before = self.pool.get_cached_block(block_hash)
        self.pool.cache_block(block, block_hash)
        if not self.pool.enable_caching:
            assert block.block_hash is None and not self.pool.is_cached(block_hash)
        elif old_hash is not None:
            assert block.block_hash == old_hash  # already registered: a no-op
        elif owner_before is None:
            assert self.pool.get_cached_block(block_hash) is block
        else:
            assert self.pool.get_cached_block(block_hash) is owner_before  # first owner kept

    @rule(block_hash=st.sampled_from(HASHES))
    def touch_block_found_by_hash(self, block_hash):
        block = self.pool.get_cached_block(block_hash)
        if block is None:
            return
        was_free = block.ref_cnt == 0
        free_before = self.pool.num_free_blocks
        evictions_before = self.pool.num_evictions
        self.pool.touch([block])
        # Reused as is: still registered under the same hash, nothing recomputed or evicted.
        assert block.block_hash == block_hash and self.pool.get_cached_block(block_hash) is block
        assert self.pool.num_evictions == evictions_before
        assert self.pool.num_free_blocks == free_before - was_free
        self.held.append(block.block_id)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def touch_block_in_use(self, data):
        block_id = data.draw(st.sampled_from(self.held), label="block")
        free_before = self.pool.num_free_blocks
        self.pool.touch([self.pool.blocks[block_id]])
        assert self.pool.num_free_blocks == free_before
        self.held.append(block_id)

    @rule()
    def reset_prefix_cache(self):
        ok = self.pool.reset_prefix_cache()
        assert ok == (not self.held)
        if ok:
            assert not any(self.pool.is_cached(h) for h in HASHES)
            assert all(b.block_hash is None for b in self.pool.blocks)
            self.hashed_when_freed = {i: False for i in self.hashed_when_freed}

    # ---- invariants ------------------------------------------------------------------------
    @invariant()
    def pool_is_consistent(self):
        self.pool.check_invariants()
        for block in self.pool.blocks:
            assert block.ref_cnt == self.refs(block.block_id) >= 0
        assert self.pool.num_free_blocks == sum(b.ref_cnt == 0 for b in self.pool.blocks)
        assert self.pool.num_used_blocks == len(set(self.held))
        assert 0.0 <= self.pool.usage <= 1.0
        for h in HASHES:
            block = self.pool.get_cached_block(h)
            assert self.pool.is_cached(h) == (block is not None)
            if block is not None:
                assert block.block_hash == h


TestBlockPoolStateMachine = BlockPoolMachine.TestCase
TestBlockPoolStateMachine.settings = settings(max_examples=50, stateful_step_count=30,
                                              deadline=None)


# ---- explicit scenarios ----------------------------------------------------------------------
def test_least_recently_freed_cached_block_is_evicted_first():
    pool = BlockPool(4)
    a, b, c, d = pool.allocate(4)
    for block, h in zip((a, b, c, d), HASHES):
        pool.cache_block(block, h)
    pool.free([c])
    pool.free([a])
    pool.free([d])
    pool.free([b])
    assert [blk.block_id for blk in pool.allocate(2)] == [c.block_id, a.block_id]
    assert not pool.is_cached(HASHES[2]) and not pool.is_cached(HASHES[0])
    assert pool.get_cached_block(HASHES[3]) is d and pool.get_cached_block(HASHES[1]) is b
    assert pool.num_evictions == 2
    pool.check_invariants()


def test_touch_then_free_makes_a_block_most_recent():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    for block, h in zip(blocks, HASHES):
        pool.cache_block(block, h)
    pool.free(blocks)  # queue: 0, 1, 2
    pool.touch([pool.get_cached_block(HASHES[0])])
    pool.free([blocks[0]])  # queue: 1, 2, 0
    assert [blk.block_id for blk in pool.allocate(3)] == [1, 2, 0]
    pool.check_invariants()


def test_uncached_blocks_are_reused_before_cached_ones():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.cache_block(a, HASHES[0])
    pool.free([a])
    pool.free([b, c])  # no hash: nothing can reuse them, so they go first
    popped = [blk.block_id for blk in pool.allocate(2)]
    assert sorted(popped) == sorted([b.block_id, c.block_id])
    assert pool.get_cached_block(HASHES[0]) is a
    pool.check_invariants()


def test_cached_free_block_is_found_and_reused_without_recompute():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.cache_block(a, HASHES[0])
    pool.free([a])
    assert pool.num_free_blocks == 2
    found = pool.get_cached_block(HASHES[0])
    assert found is a
    pool.touch([found])
    assert found.ref_cnt == 1 and found.block_hash == HASHES[0] and pool.num_free_blocks == 1
    # A second user shares it.
    pool.touch([pool.get_cached_block(HASHES[0])])
    assert a.ref_cnt == 2
    pool.free([a])
    pool.free([a])
    assert pool.num_free_blocks == 2 and pool.is_cached(HASHES[0])
    pool.check_invariants()


def test_disabled_caching_never_registers_hashes():
    pool = BlockPool(2, enable_caching=False)
    (a,) = pool.allocate(1)
    pool.cache_block(a, HASHES[0])
    assert not pool.is_cached(HASHES[0]) and a.block_hash is None


def test_bad_sizes_and_double_free_raise():
    with pytest.raises(ValueError):
        BlockPool(0)
    pool = BlockPool(1)
    with pytest.raises(RuntimeError):
        pool.allocate(2)
    (a,) = pool.allocate(1)
    pool.free([a])
    with pytest.raises(RuntimeError):
        pool.free([a])


def test_double_free_leaves_the_pool_unchanged():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.free([a])
    with pytest.raises(RuntimeError):
        pool.free([a])
    assert a.ref_cnt == 0
    pool.check_invariants()
