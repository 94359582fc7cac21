"""The KV cache starts zeroed: masked padding reads unwritten slots, and attention weights of
0 times a NaN left in recycled memory is still NaN."""
from __future__ import annotations

import torch

from deepinfer.runtime.kv_cache import KVCacheSpec, PagedKVCache


def test_cache_is_zero_even_in_memory_just_freed_full_of_nan():
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4,
                       dtype=torch.float32)
    num_blocks = 16
    shape = (spec.num_layers, 2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    for _ in range(5):
        # 16 KiB, under malloc's mmap threshold: the allocator hands this memory straight
        # back to the next request of the same size, NaNs and all.
        poison = torch.full(shape, float("nan"))
        del poison
        cache = PagedKVCache(spec, num_blocks, torch.device("cpu"))
        assert cache.kv.shape == shape
        assert not cache.kv.isnan().any()
        assert torch.equal(cache.kv, torch.zeros(shape))
        del cache
