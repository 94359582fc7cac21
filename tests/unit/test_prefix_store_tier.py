"""`SharedPrefixTier` over a tiny CPU paged cache and an in-memory store: loading a prompt's
store blocks never evicts its own device-cached head, and loaded KV is bit-exact."""
from __future__ import annotations

import torch

from deepinfer.cluster.prefix_store_tier import SharedPrefixTier, layout_for_cache
from deepinfer.core.kv_cache_manager import KVCacheManager
from deepinfer.core.request import Request
from deepinfer.kvstore import open_store
from deepinfer.kvstore.tensor_codec import kv_block_to_bytes
from deepinfer.runtime.kv_cache import KVCacheSpec, PagedKVCache
from deepinfer.sampling_params import SamplingParams

BS = 2


def make_tier(num_blocks: int) -> tuple[SharedPrefixTier, PagedKVCache, KVCacheManager]:
    cache = PagedKVCache(KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=4, block_size=BS,
                                     dtype=torch.float32), num_blocks, torch.device("cpu"))
    kv = KVCacheManager(num_blocks, BS)
    layout = layout_for_cache(cache)
    store = open_store("memory", b"s" * 16, layout=layout.descriptor)
    return SharedPrefixTier(store, cache, kv, layout), cache, kv


def block_kv(i: int) -> torch.Tensor:
    """Distinct content for the prompt's i-th block: [layers, 2, 1 block, slot, head, dim]."""
    return torch.full((2, 2, 1, BS, 1, 4), float(i + 1))


def compute_on_device(kv: KVCacheManager, request_id: str, tokens: list[int]) -> None:
    """Admit and free a request as the scheduler would (its full blocks stay cached-free)."""
    request = Request(request_id, list(tokens), SamplingParams(max_tokens=1))
    assert kv.allocate_slots(request, len(tokens))
    kv.free(request)


def test_store_load_keeps_the_device_cached_head_of_the_prompt():
    tier, cache, kv = make_tier(num_blocks=8)
    prompt = list(range(100, 113))  # 6 full blocks (+1 token left to compute)
    hashes = tier.block_hashes(prompt)
    for i, block_hash in enumerate(hashes):
        tier.store.put(block_hash, kv_block_to_bytes(block_kv(i), tier.layout))
    compute_on_device(kv, "head", prompt[:2 * BS])  # the prompt's first 2 blocks, on device
    compute_on_device(kv, "other", list(range(12)))  # 6 newer cached blocks: the head is LRU
    head_ids = [kv.pool.get_cached_block(h).block_id for h in hashes[:2]]

    load = tier.load_prefix(prompt)

    assert load.num_device_blocks == 2 and load.num_store_blocks >= 1
    num_cached = 0
    while num_cached < len(hashes) and kv.pool.is_cached(hashes[num_cached]):
        num_cached += 1
    # The head was not evicted to make room for the blocks behind it.
    assert [kv.pool.get_cached_block(h).block_id for h in hashes[:2]] == head_ids
    assert num_cached == load.num_device_blocks + load.num_store_blocks
    for i in range(2, num_cached):
        block = kv.pool.get_cached_block(hashes[i])
        assert torch.equal(cache.read_blocks([block.block_id]), block_kv(i))
    assert kv.pool.num_used_blocks == 0  # everything is released, cached-free
    kv.check_invariants()


def test_loaded_blocks_are_evicted_tail_first():
    tier, _, kv = make_tier(num_blocks=8)
    prompt = list(range(100, 107))  # 3 full blocks
    hashes = tier.block_hashes(prompt)
    for i, block_hash in enumerate(hashes):
        tier.store.put(block_hash, kv_block_to_bytes(block_kv(i), tier.layout))
    assert tier.load_prefix(prompt).num_store_blocks == 3
    kv.pool.allocate(6)  # the 5 never-used blocks, then one eviction: the chain's tail
    assert [kv.pool.is_cached(h) for h in hashes] == [True, True, False]
