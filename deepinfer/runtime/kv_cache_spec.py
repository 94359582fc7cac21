"""The KV cache layout a model needs: per-head K/V (MHA/GQA, `KVCacheSpec`) or one latent
entry per token (MLA, `MLAKVCacheSpec`). Block bytes, and so how many blocks a memory budget
holds, come from the spec."""
from __future__ import annotations

import torch

from deepinfer.models.model_config import ModelConfig
from deepinfer.runtime.kv_cache import KVCacheSpec, PagedKVCache
from deepinfer.runtime.latent_kv_cache import MLAKVCacheSpec, PagedLatentKVCache

AnyKVCacheSpec = KVCacheSpec | MLAKVCacheSpec
AnyKVCache = PagedKVCache | PagedLatentKVCache


def kv_cache_spec_for(config: ModelConfig, block_size: int, dtype: torch.dtype) -> AnyKVCacheSpec:
    if config.mla is not None:
        return MLAKVCacheSpec.from_model_config(config, block_size, dtype)
    return KVCacheSpec.from_model_config(config, block_size, dtype)


def allocate_kv_cache(spec: AnyKVCacheSpec, num_blocks: int, device: torch.device) -> AnyKVCache:
    if isinstance(spec, MLAKVCacheSpec):
        return PagedLatentKVCache(spec, num_blocks, device)
    return PagedKVCache(spec, num_blocks, device)


def kv_bytes_per_token(spec: AnyKVCacheSpec) -> int:
    return spec.bytes_per_block // spec.block_size
