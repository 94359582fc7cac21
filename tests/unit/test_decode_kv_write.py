"""A pulled KV payload arrives in host memory in the sender's dtype; the decode worker's cache
may live on an accelerator in another dtype. `write_received_kv` copies it to the cache's
device and dtype (a "meta" cache stands in for CUDA: any cross-device write raises there)."""
from __future__ import annotations

import torch

from deepinfer.cluster.decode_worker import write_received_kv
from deepinfer.runtime.kv_cache import KVCacheSpec, PagedKVCache

SPEC = dict(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)


def payload(num_blocks: int, dtype=torch.float32) -> torch.Tensor:
    s = SPEC
    return torch.randn(s["num_layers"], 2, num_blocks, s["block_size"], s["num_kv_heads"],
                       s["head_dim"]).to(dtype)


def test_host_payload_is_written_into_a_cache_on_another_device():
    cache = PagedKVCache(KVCacheSpec(**SPEC, dtype=torch.bfloat16), 6, torch.device("meta"))
    write_received_kv(cache, [1, 4], payload(2))  # CPU fp32 -> meta bf16: no device error
    assert cache.kv.device.type == "meta" and cache.kv.dtype == torch.bfloat16


def test_values_land_in_the_given_blocks_in_the_cache_dtype():
    cache = PagedKVCache(KVCacheSpec(**SPEC, dtype=torch.bfloat16), 6, torch.device("cpu"))
    kv = payload(2)
    write_received_kv(cache, [5, 2], kv)
    assert torch.equal(cache.read_blocks([5, 2]), kv.to(torch.bfloat16))
