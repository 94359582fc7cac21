"""The MLA latent paged cache: one "head" of (kv_lora_rank + qk_rope_head_dim) values per token
per layer, instead of per-head K and V.

    kv[layer, block_id, slot_in_block, latent (r) | k_pe (rope)]

Same block ids and slots as the MHA cache (`PagedKVCache`), and the same `read_blocks` /
`write_blocks` contract (a copy of whole blocks, block axis 1 here), so the KV transfer and the
shared prefix store work unchanged; their layout descriptor (and so the store salt) differs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.models.model_config import ModelConfig
from deepinfer.runtime.kv_cache import blocks_that_fit


@dataclass(frozen=True)
class MLAKVCacheSpec:
    num_layers: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    block_size: int
    dtype: torch.dtype

    is_latent = True  # ClassVar: runners pick the MLA attention backend on it

    @classmethod
    def from_model_config(cls, config: ModelConfig, block_size: int, dtype: torch.dtype) -> "MLAKVCacheSpec":
        if config.mla is None:
            raise ValueError(f"{config.architecture} has no latent attention")
        return cls(config.num_hidden_layers, config.mla.kv_lora_rank, config.mla.qk_rope_head_dim,
                   block_size, dtype)

    @property
    def entry_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def bytes_per_token(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * self.entry_dim * elem

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def num_blocks_for(self, memory_bytes: int) -> int:
        return blocks_that_fit(memory_bytes, self.bytes_per_block)


class PagedLatentKVCache:
    def __init__(self, spec: MLAKVCacheSpec, num_blocks: int, device: torch.device) -> None:
        self.spec = spec
        self.num_blocks = num_blocks
        # zeros: masked slots still meet the attention matmuls, and 0 * NaN garbage is NaN.
        self.kv = torch.zeros(spec.num_layers, num_blocks, spec.block_size, spec.entry_dim,
                              dtype=spec.dtype, device=device)

    def layer(self, layer_idx: int) -> torch.Tensor:
        """One layer's entries: [num_blocks, block_size, r + rope]."""
        return self.kv[layer_idx]

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Copy of whole blocks: [num_layers, len(block_ids), block_size, r + rope]."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.kv.device)
        return self.kv.index_select(1, index)

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        index = torch.tensor(block_ids, dtype=torch.long, device=self.kv.device)
        self.kv.index_copy_(1, index, data.to(self.kv.dtype))
