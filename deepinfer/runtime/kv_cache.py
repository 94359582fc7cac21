"""Paged KV cache tensors and their sizing from a memory budget.

Layout, one tensor for all layers, token-major inside a block:

    kv[layer, 0=K|1=V, block_id, slot_in_block, kv_head, head_dim]

A token's slot is block_id * block_size + slot_in_block. Gathering a request's blocks is then
one index_select of contiguous block_size*kv_heads*head_dim runs, and the gathered
[tokens, kv_heads, head_dim] tensor feeds SDPA as a strided [kv_heads, tokens, head_dim] view
(measured ~4x faster than a head-major layout, whose gather needs a strided index).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from deepinfer.models.model_config import ModelConfig

_UNITS = {"": 1, "B": 1, "K": 1000, "KB": 1000, "KIB": 1024, "M": 1000**2, "MB": 1000**2,
          "MIB": 1024**2, "G": 1000**3, "GB": 1000**3, "GIB": 1024**3, "T": 1000**4,
          "TB": 1000**4, "TIB": 1024**4}


def parse_memory(text: str | int) -> int:
    """'4GiB' / '512MiB' / '2G' / 1000 -> bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not match or match.group(2).upper() not in _UNITS:
        raise ValueError(f"cannot parse memory size {text!r} (use e.g. '4GiB', '512MiB')")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def blocks_that_fit(memory_bytes: int, bytes_per_block: int) -> int:
    """How many KV blocks a memory budget holds; fewer than 2 is a configuration error."""
    num = memory_bytes // bytes_per_block
    if num < 2:
        raise ValueError(f"KV cache memory {memory_bytes} B holds fewer than 2 blocks "
                         f"({bytes_per_block} B each)")
    return int(num)


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @classmethod
    def from_model_config(cls, config: ModelConfig, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        return cls(config.num_hidden_layers, config.num_key_value_heads, config.head_dim,
                   block_size, dtype)

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.block_size * self.head_dim * elem

    def num_blocks_for(self, memory_bytes: int) -> int:
        return blocks_that_fit(memory_bytes, self.bytes_per_block)


class PagedKVCache:
    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device) -> None:
        self.spec = spec
        self.num_blocks = num_blocks
        # zeros, not empty: masked padding still reads unwritten slots, and a 0 attention
        # weight times a NaN left in recycled memory is NaN.
        self.kv = torch.zeros(spec.num_layers, 2, num_blocks, spec.block_size, spec.num_kv_heads,
                              spec.head_dim, dtype=spec.dtype, device=device)
        # Per-layer views made once: each step's attention would otherwise slice and view the
        # cache again in every layer (a dozen tiny ops per layer at batch 1).
        self._layers = [(self.kv[i, 0], self.kv[i, 1]) for i in range(spec.num_layers)]
        self._slot_views = [(k.view(-1, spec.num_kv_heads, spec.head_dim),
                             v.view(-1, spec.num_kv_heads, spec.head_dim)) for k, v in self._layers]

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of one layer, each [num_blocks, block_size, kv_heads, head_dim]."""
        return self._layers[layer_idx]

    def layer_slots(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of one layer as [num_blocks * block_size, kv_heads, head_dim] slot rows."""
        return self._slot_views[layer_idx]

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Copy of whole blocks: [num_layers, 2, len(block_ids), block_size, kv_heads, head_dim]."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.kv.device)
        return self.kv.index_select(2, index)

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        index = torch.tensor(block_ids, dtype=torch.long, device=self.kv.device)
        self.kv.index_copy_(2, index, data.to(self.kv.dtype))
