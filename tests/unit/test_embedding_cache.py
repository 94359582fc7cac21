"""EmbeddingCache: LRU by bytes, hit/miss counters, and the shared-store tier behind get/put."""
from __future__ import annotations

import torch

from deepinfer.multimodal.embedding_cache import EmbeddingCache


def embeds(rows: int, value: float = 0.0) -> torch.Tensor:
    return torch.full((rows, 4), value, dtype=torch.float32)  # 16 bytes per row


def test_lru_evicts_least_recently_used_by_bytes():
    cache = EmbeddingCache(capacity_bytes=3 * 32)
    for name in "abc":
        cache.put(name, embeds(2))
    assert cache.get("a") is not None  # a is now most recent
    cache.put("d", embeds(2))
    assert "b" not in cache and {"a", "c", "d"} <= {k for k in "abcd" if k in cache}
    assert cache.used_bytes == 96 and cache.num_evicted == 1
    assert cache.get("b") is None
    assert (cache.hits, cache.misses) == (1, 1)


def test_replacing_an_entry_keeps_the_byte_count_right():
    cache = EmbeddingCache(capacity_bytes=1000)
    cache.put("a", embeds(2))
    cache.put("a", embeds(5))
    assert cache.used_bytes == 80 and len(cache) == 1


def test_entry_larger_than_capacity_is_not_kept():
    cache = EmbeddingCache(capacity_bytes=16)
    cache.put("small", embeds(1))
    cache.put("big", embeds(2))
    assert "big" not in cache and "small" in cache


class DictStore:
    def __init__(self):
        self.data = {}

    def get(self, image_hash):
        return self.data.get(image_hash)

    def put(self, image_hash, tensor):
        self.data[image_hash] = tensor


def test_store_tier_behind_get_and_put():
    store = DictStore()
    writer = EmbeddingCache(capacity_bytes=1000, store=store)
    writer.put("img", embeds(2, 1.5))
    assert "img" in store.data  # written through
    reader = EmbeddingCache(capacity_bytes=1000, store=store)
    assert torch.equal(reader.get("img"), embeds(2, 1.5))
    assert reader.get("img") is not None  # now local
    assert reader.get("other") is None
    assert reader.hits_by_tier == {"local": 1, "store": 1}
    assert (reader.hits, reader.misses) == (2, 1)


def test_shared_store_tier_round_trips_embeddings_between_caches():
    from deepinfer.kvstore.memory_store import MemoryKVBlockStore
    from deepinfer.multimodal.embedding_store import StoreEmbeddingTier, embedding_store_salt

    store = MemoryKVBlockStore(embedding_store_salt("weights-a"))
    encoder_side = EmbeddingCache(1 << 20, store=StoreEmbeddingTier(store))
    prefill_side = EmbeddingCache(1 << 20, store=StoreEmbeddingTier(store))
    value = torch.arange(24, dtype=torch.float32).reshape(3, 8).to(torch.bfloat16)
    encoder_side.put("abc", value)
    got = prefill_side.get("abc")
    assert got.dtype == torch.bfloat16 and torch.equal(got, value)
    assert prefill_side.hits_by_tier["store"] == 1
    assert prefill_side.get("missing") is None
    # Another model's salt never sees these embeddings.
    assert embedding_store_salt("weights-a") != embedding_store_salt("weights-b")
