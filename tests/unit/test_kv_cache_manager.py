"""KVCacheManager: all-or-nothing allocate_slots, longest-prefix matching, sharing, free.

A hypothesis state machine admits, extends and frees requests whose prompts come from a tiny
alphabet (so prefixes are shared often) over a small pool. A content model records which token
prefix each block holds once computed, so a prefix hit is checked against what the blocks
really contain, not only against the pool's own hash map.
"""
from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, consumes, initialize, invariant,
                                 rule)

from deepinfer.core.kv_cache_manager import KVCacheManager, PrefixHit
from deepinfer.core.prefix_hash import hash_request_blocks, salt_hash
from deepinfer.core.request import Request
from deepinfer.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=None)
prompt_st = st.lists(st.integers(1, 2), min_size=1, max_size=24)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_request(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id=request_id, prompt_token_ids=list(prompt), sampling_params=PARAMS)


def snapshot(kv: KVCacheManager) -> tuple:
    """Everything allocate_slots may touch, including the free-queue order."""
    pool = kv.pool
    return (
        {rid: [b.block_id for b in table] for rid, table in kv.req_blocks.items()},
        dict(kv._num_hashed_blocks),
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        list(pool._free),
        dict(pool._cached),
        pool.num_evictions,
    )


class KVCacheMachine(RuleBasedStateMachine):
    active = Bundle("active")

    @initialize(num_blocks=st.integers(1, 12), block_size=st.sampled_from([1, 2, 4]),
                caching=st.booleans())
    def setup(self, num_blocks, block_size, caching):
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching,
                                 hash_salt=salt_hash("test-model"))
        self.bs = block_size
        self.ids = itertools.count()
        self.live: dict[str, Request] = {}
        # block id -> the full token prefix (tokens[0 : end of block]) it holds, once computed.
        self.content: dict[int, tuple[int, ...]] = {}

    # ---- model helpers ---------------------------------------------------------------------
    def record_computed(self, request: Request, old_len: int, num_hit_blocks: int) -> None:
        table = self.kv.req_blocks[request.request_id]
        for block in table[max(old_len, num_hit_blocks):]:
            self.content.pop(block.block_id, None)  # freshly allocated: old contents are gone
        for i in range(request.num_computed_tokens // self.bs):
            self.content[table[i].block_id] = tuple(request.all_token_ids[:(i + 1) * self.bs])

    def check_hit(self, request: Request, hit: PrefixHit) -> None:
        assert hit.num_tokens == len(hit.blocks) * self.bs
        assert hit.num_tokens <= request.num_tokens - 1  # at least one token left to compute
        if not self.kv.enable_prefix_caching:
            assert hit.blocks == []
            return
        tokens = request.all_token_ids
        for i, block in enumerate(hit.blocks):
            assert self.content.get(block.block_id) == tuple(tokens[:(i + 1) * self.bs])
        # Longest: the next block (if it could be used) is not in the cache.
        hashes = hash_request_blocks(tokens, self.bs, parent=self.kv.hash_salt)
        assert request.block_hashes[:len(hashes)] == hashes  # the one hash function
        k = len(hit.blocks)
        if k < (request.num_tokens - 1) // self.bs:
            assert not self.kv.pool.is_cached(hashes[k])

    # ---- rules -----------------------------------------------------------------------------
    @rule(target=active, prompt=prompt_st, data=st.data())
    def admit(self, prompt, data):
        request = make_request(f"r{next(self.ids)}", prompt)
        hit = self.kv.find_prefix(request)
        self.check_hit(request, hit)
        num_new = data.draw(st.integers(1, request.num_tokens - hit.num_tokens), label="num_new")
        before = snapshot(self.kv)
        need = self.kv.num_blocks_needed(request, num_new, hit)
        request.num_computed_tokens = hit.num_tokens
        if not self.kv.allocate_slots(request, num_new, hit):
            assert need > len(before[3])
            assert snapshot(self.kv) == before
            return None
        assert self.kv.pool.num_free_blocks == len(before[3]) - need
        for block in hit.blocks:
            assert block.ref_cnt >= 1
        request.num_computed_tokens = hit.num_tokens + num_new
        assert len(self.kv.req_blocks[request.request_id]) == cdiv(request.num_computed_tokens,
                                                                    self.bs)
        self.record_computed(request, 0, len(hit.blocks))
        self.live[request.request_id] = request
        return request.request_id

    @rule(request_id=active, data=st.data())
    def extend(self, request_id, data):
        request = self.live.get(request_id)
        if request is None:
            return
        if request.num_computed_tokens == request.num_tokens:
            request.append_output_token(data.draw(st.integers(1, 2), label="token"))
        remaining = request.num_tokens - request.num_computed_tokens
        num_new = data.draw(st.integers(1, remaining), label="num_new")
        before = snapshot(self.kv)
        old_len = len(self.kv.req_blocks[request_id])
        need = self.kv.num_blocks_needed(request, num_new)
        if not self.kv.allocate_slots(request, num_new):
            assert need > len(before[3])
            assert snapshot(self.kv) == before
            return
        assert self.kv.pool.num_free_blocks == len(before[3]) - need
        request.num_computed_tokens += num_new
        assert len(self.kv.req_blocks[request_id]) == cdiv(request.num_computed_tokens, self.bs)
        self.record_computed(request, old_len, 0)

    @rule(request_id=consumes(active))
    def free(self, request_id):
        request = self.live.pop(request_id, None)
        if request is not None:
            self.kv.free(request)
            assert request_id not in self.kv.req_blocks

    # ---- invariants ------------------------------------------------------------------------
    @invariant()
    def consistent(self):
        self.kv.check_invariants()
        assert set(self.kv.req_blocks) == set(self.live)
        used = set()
        for rid, table in self.kv.req_blocks.items():
            ids = [b.block_id for b in table]
            assert len(ids) == len(set(ids))
            assert len(ids) == cdiv(self.live[rid].num_computed_tokens, self.bs)
            used |= set(ids)
        assert self.kv.pool.num_used_blocks == len(used)

    def teardown(self):
        if not hasattr(self, "kv"):
            return
        for request in list(self.live.values()):
            self.kv.free(request)
        self.kv.check_invariants()
        assert self.kv.pool.num_used_blocks == 0 and self.kv.usage == 0.0
        assert all(b.ref_cnt == 0 for b in self.kv.pool.blocks)


TestKVCacheStateMachine = KVCacheMachine.TestCase
TestKVCacheStateMachine.settings = settings(max_examples=45, stateful_step_count=25,
                                            deadline=None)


# ---- explicit properties and scenarios -------------------------------------------------------
def admit_whole(kv: KVCacheManager, request: Request) -> PrefixHit:
    hit = kv.find_prefix(request)
    request.num_computed_tokens = hit.num_tokens
    assert kv.allocate_slots(request, request.num_tokens - hit.num_tokens, hit)
    kv.record_prefix_query(request.num_tokens, hit.num_tokens)
    request.num_computed_tokens = request.num_tokens
    return hit


@settings(max_examples=40, deadline=None)
@given(shared=st.lists(st.integers(0, 9), min_size=0, max_size=20),
       tail_a=st.lists(st.integers(10, 19), min_size=1, max_size=9),
       tail_b=st.lists(st.integers(20, 29), min_size=1, max_size=9))
def test_requests_with_equal_prefixes_share_exactly_the_full_shared_blocks(shared, tail_a, tail_b):
    bs = 4
    kv = KVCacheManager(num_blocks=32, block_size=bs)
    a = make_request("a", shared + tail_a)
    b = make_request("b", shared + tail_b)
    admit_whole(kv, a)
    hit = admit_whole(kv, b)
    num_shared = len(shared) // bs  # full blocks made only of the shared prefix
    assert len(hit.blocks) == num_shared
    table_a, table_b = kv.req_blocks["a"], kv.req_blocks["b"]
    assert table_b[:num_shared] == table_a[:num_shared]
    assert not {x.block_id for x in table_b[num_shared:]} & {x.block_id for x in table_a}
    assert all(x.ref_cnt == 2 for x in table_a[:num_shared])
    kv.check_invariants()
    kv.free(a)
    kv.free(b)
    assert kv.pool.num_used_blocks == 0
    kv.check_invariants()


def test_prefix_hit_leaves_one_token_and_counters_add_up():
    bs = 4
    kv = KVCacheManager(num_blocks=16, block_size=bs)
    prompt = list(range(100, 112))  # exactly 3 full blocks
    first = make_request("first", prompt)
    assert admit_whole(kv, first).num_tokens == 0
    kv.free(first)
    again = make_request("again", prompt)
    hit = admit_whole(kv, again)
    # All 12 tokens are cached, but the last block is recomputed so the step has logits.
    assert hit.num_tokens == 8 and len(hit.blocks) == 2
    longer = make_request("longer", prompt + [7])
    assert kv.find_prefix(longer).num_tokens == 12
    assert kv.num_prefix_queries == 24 and kv.num_prefix_hits == 8
    kv.free(again)
    assert kv.usage == 0.0


def test_failed_allocation_with_a_prefix_hit_changes_nothing():
    bs = 2
    kv = KVCacheManager(num_blocks=4, block_size=bs)
    owner = make_request("owner", [1, 2, 3, 4, 5])  # 3 blocks, 2 full ones cached
    admit_whole(kv, owner)
    kv.free(owner)
    hog = make_request("hog", [9])
    admit_whole(kv, hog)  # takes the one block that was never cached
    needy = make_request("needy", [1, 2, 3, 4, 5, 6, 7, 8, 9])  # hit 2 blocks, needs 3 more
    hit = kv.find_prefix(needy)
    assert len(hit.blocks) == 2
    before = snapshot(kv)
    needy.num_computed_tokens = hit.num_tokens
    assert not kv.allocate_slots(needy, needy.num_tokens - hit.num_tokens, hit)
    assert snapshot(kv) == before
    assert all(kv.pool.is_cached(h) for h in needy.block_hashes[:2])


def test_free_returns_every_block_and_keeps_full_blocks_cached():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r0, r1, r2 = (make_request(f"r{i}", list(range(10 * i, 10 * i + 10))) for i in range(3))
    admit_whole(kv, r0)
    admit_whole(kv, r1)
    assert kv.pool.num_used_blocks == 6
    kv.free(r0)
    assert kv.pool.num_used_blocks == 3
    # r0's partial tail block and the two never-used blocks are taken before its cached ones.
    admit_whole(kv, r2)
    assert kv.pool.num_evictions == 0
    assert all(kv.pool.is_cached(h) for h in r0.block_hashes)
    kv.free(r1)
    kv.free(r2)
    kv.free(r2)  # freeing an already freed request is a no-op
    assert kv.pool.num_used_blocks == 0 and kv.usage == 0.0
    assert kv.pool.num_free_blocks == kv.num_blocks and not kv.req_blocks
    kv.check_invariants()
    assert all(kv.pool.is_cached(h) for r in (r0, r1, r2) for h in r.block_hashes)


def test_disabled_prefix_caching_never_hits():
    kv = KVCacheManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = make_request("a", [1, 2, 3, 4, 5])
    admit_whole(kv, a)
    b = make_request("b", [1, 2, 3, 4, 5])
    assert admit_whole(kv, b).num_tokens == 0
    assert kv.pool.num_used_blocks == 6


def test_salt_separates_caches():
    prompt = list(range(9))
    kv = KVCacheManager(num_blocks=8, block_size=4, hash_salt=salt_hash("model-a"))
    a = make_request("a", prompt)
    admit_whole(kv, a)
    other = make_request("b", prompt)
    other.block_hashes.extend(hash_request_blocks(prompt, 4, parent=salt_hash("model-b")))
    assert not any(kv.pool.is_cached(h) for h in other.block_hashes)
    assert all(kv.pool.is_cached(h) for h in a.block_hashes)


def test_prefix_hit_on_a_request_with_blocks_is_rejected():
    kv = KVCacheManager(num_blocks=8, block_size=2)
    a = make_request("a", [1, 2, 3])
    admit_whole(kv, a)
    b = make_request("b", [1, 2, 3])
    hit = kv.find_prefix(b)
    b.num_computed_tokens = hit.num_tokens
    assert kv.allocate_slots(b, 1, hit)
    with pytest.raises(AssertionError):
        kv.allocate_slots(b, 1, hit)


def test_freed_request_evicts_its_tail_blocks_first():
    bs = 2
    kv = KVCacheManager(num_blocks=4, block_size=bs)
    prompt = [1, 2, 3, 4, 5, 6, 7]  # 3 full blocks + a partial one
    a = make_request("a", prompt)
    admit_whole(kv, a)
    kv.free(a)
    assert kv.pool.num_used_blocks == 0
    other = make_request("other", [9, 9, 9])  # takes the partial block, then evicts one more
    admit_whole(kv, other)
    again = make_request("again", prompt)
    assert kv.find_prefix(again).num_tokens == 2 * bs  # the prompt's head survives
    kv.check_invariants()


def test_a_gap_in_the_cached_chain_ends_the_match():
    bs = 2
    kv = KVCacheManager(num_blocks=4, block_size=bs)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    a = make_request("a", prompt)
    admit_whole(kv, a)
    kv.free(a)
    pool = kv.pool
    # Keep blocks 1 and 2 alive, evict block 0: later blocks exist but the chain is broken.
    later = [pool.get_cached_block(h) for h in a.block_hashes[1:3]]
    pool.touch(later)
    pool.free(pool.allocate(pool.num_free_blocks))
    pool.free(later)
    assert not pool.is_cached(a.block_hashes[0])
    assert pool.is_cached(a.block_hashes[1]) and pool.is_cached(a.block_hashes[2])
    hit = kv.find_prefix(make_request("b", prompt))
    assert hit.blocks == [] and hit.num_tokens == 0


class FakeTier:
    """A lower tier holding some of a prompt's blocks; records what was written where."""

    def __init__(self, stored: dict[bytes, str], fail_on: bytes | None = None) -> None:
        self.stored = stored
        self.fail_on = fail_on
        self.fetched: list[bytes] = []
        self.written: dict[int, str] = {}

    def fetch(self, block_hash: bytes) -> str | None:
        self.fetched.append(block_hash)
        return self.stored.get(block_hash)

    def write(self, block_id: int, payload: str) -> None:
        if payload == self.fail_on:
            raise OSError("device write failed")
        self.written[block_id] = payload


def cache_then_age(kv: KVCacheManager, prompt: list[int], newer: list[int]) -> None:
    """Compute `prompt` and free it, then compute and free `newer` so the prompt's blocks
    become the least recently used cached-free blocks (first in line for eviction)."""
    for rid, tokens in (("cached", prompt), ("newer", newer)):
        r = make_request(rid, tokens)
        admit_whole(kv, r)
        kv.free(r)


def test_tier_load_references_the_device_head_before_allocating():
    bs = 2
    kv = KVCacheManager(num_blocks=8, block_size=bs)
    prompt = list(range(100, 113))  # 6 full blocks + 1 token to compute
    hashes = hash_request_blocks(prompt, bs)[:6]
    cache_then_age(kv, prompt[:4], list(range(12)))  # head: 2 blocks, LRU; 6 newer blocks
    head = [kv.pool.get_cached_block(h).block_id for h in hashes[:2]]
    tier = FakeTier({h: f"block{i}" for i, h in enumerate(hashes)})

    load = kv.load_prefix_blocks(hashes, tier.fetch, tier.write)

    assert [kv.pool.get_cached_block(h).block_id for h in hashes[:2]] == head  # not evicted
    # 6 blocks free once the head is referenced; half of them are used for loading.
    assert (load.num_device_blocks, load.num_loaded_blocks) == (2, 3)
    assert tier.fetched == hashes[2:5]
    for i in range(2, 5):
        assert tier.written[kv.pool.get_cached_block(hashes[i]).block_id] == f"block{i}"
    hit = kv.find_prefix(make_request("again", prompt))
    assert hit.num_tokens == 5 * bs
    assert kv.pool.num_used_blocks == 0
    kv.check_invariants()


def test_tier_load_stops_at_a_miss_and_uses_cached_blocks_behind_a_gap():
    bs = 2
    kv = KVCacheManager(num_blocks=16, block_size=bs)
    prompt = list(range(100, 111))  # 5 full blocks
    hashes = hash_request_blocks(prompt, bs)
    admit_whole(kv, r := make_request("r", prompt))
    kv.free(r)
    pool = kv.pool
    later = [pool.get_cached_block(h) for h in hashes[1:]]
    pool.touch(later)  # evict the head only: blocks 1..4 stay cached behind a gap
    pool.free(pool.allocate(pool.num_free_blocks))
    pool.free(later)
    assert [pool.is_cached(h) for h in hashes] == [False, True, True, True, True]
    tier = FakeTier({hashes[0]: "block0"})
    load = kv.load_prefix_blocks(hashes, tier.fetch, tier.write)
    assert (load.num_device_blocks, load.num_loaded_blocks) == (0, 1)
    assert tier.fetched == hashes[:1]  # cached blocks are never fetched
    assert kv.find_prefix(make_request("again", prompt + [1])).num_tokens == 5 * bs

    kv2 = KVCacheManager(num_blocks=16, block_size=bs)
    tier2 = FakeTier({hashes[0]: "block0", hashes[2]: "block2"})
    load = kv2.load_prefix_blocks(hashes, tier2.fetch, tier2.write)
    assert (load.num_device_blocks, load.num_loaded_blocks) == (0, 1)
    assert tier2.fetched == hashes[:2]  # block 1 missed: the load ends there
    assert not kv2.pool.is_cached(hashes[2])
    kv2.check_invariants()


def test_a_failed_tier_write_releases_every_block():
    bs = 2
    kv = KVCacheManager(num_blocks=8, block_size=bs)
    prompt = list(range(100, 109))
    hashes = hash_request_blocks(prompt, bs)
    admit_whole(kv, r := make_request("head", prompt[:3]))  # block 0 cached on device
    kv.free(r)
    tier = FakeTier({h: f"block{i}" for i, h in enumerate(hashes)}, fail_on="block2")
    with pytest.raises(OSError):
        kv.load_prefix_blocks(hashes, tier.fetch, tier.write)
    assert kv.pool.num_used_blocks == 0
    # Block 1 was loaded before the failure; the failed block is released uncached.
    assert [kv.pool.is_cached(h) for h in hashes] == [True, True, False, False]
    kv.check_invariants()


def test_tier_load_is_a_no_op_without_prefix_caching():
    kv = KVCacheManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    tier = FakeTier({b"h" * 16: "x"})
    load = kv.load_prefix_blocks([b"h" * 16], tier.fetch, tier.write)
    assert (load.num_device_blocks, load.num_loaded_blocks) == (0, 0) and not tier.fetched
