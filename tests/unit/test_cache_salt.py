"""cache_salt (vLLM's tenant isolation of the prefix cache): keyed into the first block's
hash, so the same prompt under two salts shares no block, under one salt shares every block,
and an unsalted prompt hashes exactly as before salts existed."""
from __future__ import annotations

import pytest

from deepinfer.core.kv_cache_manager import KVCacheManager
from deepinfer.core.prefix_hash import ROOT_HASH, hash_block_tokens, hash_request_blocks
from deepinfer.core.request import Request
from deepinfer.invalid_parameter import InvalidParameter
from deepinfer.sampling_params import SamplingParams
from deepinfer.server.protocol import CompletionRequest
from tests.unit.test_api_request_fields import make, prepare_completion

BLOCK = 4
PROMPT = list(range(1, 14))  # three full blocks and one token


def test_salted_hashes_differ_in_every_block_and_unsalted_ones_are_unchanged():
    plain = hash_request_blocks(PROMPT, BLOCK)
    manual, parent = [], ROOT_HASH
    for i in range(3):
        parent = hash_block_tokens(parent, PROMPT[i * BLOCK:(i + 1) * BLOCK])
        manual.append(parent)
    assert plain == manual
    a = hash_request_blocks(PROMPT, BLOCK, cache_salt="tenant-a")
    b = hash_request_blocks(PROMPT, BLOCK, cache_salt="tenant-b")
    assert a == hash_request_blocks(PROMPT, BLOCK, cache_salt="tenant-a")
    assert len(a) == len(b) == 3
    assert not set(a) & set(b) and not set(a) & set(plain)
    # Only block 0 takes the salt as a key; later blocks differ because they chain from it.
    assert a[1] == hash_block_tokens(a[0], PROMPT[BLOCK:2 * BLOCK])


def served_prefix(kv: KVCacheManager, request_id: str, salt: str | None) -> int:
    """Run one request's prompt through the cache; the tokens it found cached."""
    request = Request(request_id, list(PROMPT), SamplingParams(max_tokens=4, cache_salt=salt))
    hit = kv.find_prefix(request)
    request.num_computed_tokens = hit.num_tokens
    assert kv.allocate_slots(request, request.num_tokens - hit.num_tokens, hit)
    kv.free(request)
    return hit.num_tokens


@pytest.mark.parametrize("first,second,expect_hit", [
    ("a", "b", False), ("a", "a", True), (None, "a", False), ("a", None, False),
    (None, None, True)])
def test_only_the_same_salt_hits_the_device_cache(first, second, expect_hit):
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK)
    assert served_prefix(kv, "r1", first) == 0
    assert served_prefix(kv, "r2", second) == (12 if expect_hit else 0)
    kv.check_invariants()


def test_the_api_field_reaches_the_engine_params_and_bad_salts_are_refused():
    _, params = prepare_completion(make_serving(), cache_salt="tenant-a")
    assert params.cache_salt == "tenant-a"
    _, params = prepare_completion(make_serving())
    assert params.cache_salt is None
    for bad in ("", "x" * 1025, 5):
        with pytest.raises(ValueError):
            CompletionRequest(prompt="hi", cache_salt=bad)
    with pytest.raises(InvalidParameter):
        SamplingParams(cache_salt="")


def make_serving():
    from deepinfer.server.serving_completion import OpenAIServingCompletion
    return make(OpenAIServingCompletion)


def test_the_host_tier_and_the_fs_store_behind_it_key_by_the_salt(tmp_path):
    """Tenant A's published blocks are in the host-memory tier and in the fs store behind it
    under A's salted hashes only: an unsalted request and tenant B miss in both tiers, A hits
    the host tier, and with the host tier gone (another process) A still hits the fs store."""
    import torch

    from deepinfer.cluster.prefix_store_tier import SharedPrefixTier, layout_for_cache
    from deepinfer.kvstore import open_store
    from deepinfer.kvstore.tensor_codec import kv_block_to_bytes
    from deepinfer.kvstore.tiered_store import HOST_TIER, SHARED_TIER
    from deepinfer.runtime.kv_cache import KVCacheSpec, PagedKVCache

    block = 2
    cache = PagedKVCache(KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=4, block_size=block,
                                     dtype=torch.float32), 8, torch.device("cpu"))
    layout = layout_for_cache(cache)
    url = f"{tmp_path}/store?host_cache_bytes=1000000"

    def tier() -> SharedPrefixTier:
        store = open_store(url, b"s" * 16, layout=layout.descriptor)
        return SharedPrefixTier(store, cache, KVCacheManager(8, block), layout)

    prompt = list(range(100, 109))  # 4 full blocks
    writer = tier()
    for i, block_hash in enumerate(writer.block_hashes(prompt, cache_salt="tenant-a")):
        writer.store.put(block_hash, kv_block_to_bytes(torch.full((2, 2, 1, block, 1, 4),
                                                                  float(i + 1)), layout))
    for salt in (None, "tenant-b"):
        assert {writer.store.fetch(h) for h in writer.block_hashes(prompt, cache_salt=salt)} \
            == {(None, None)}, salt
    tiers = {writer.store.fetch(h)[1] for h in writer.block_hashes(prompt, cache_salt="tenant-a")}
    assert tiers == {HOST_TIER}
    reader = tier()  # a fresh host tier: only the fs store has the blocks
    assert {reader.store.fetch(h)[1] for h in reader.block_hashes(prompt, cache_salt="tenant-b")} \
        == {None}
    assert {reader.store.fetch(h)[1] for h in reader.block_hashes(prompt, cache_salt="tenant-a")} \
        == {SHARED_TIER}
    writer.close()
    reader.close()
