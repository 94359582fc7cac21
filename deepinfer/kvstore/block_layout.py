"""`KVBlockLayout`: what one stored block's payload is (shape, dtype, axis order). Torch-free.

The layout's `descriptor` goes into every block header and is checked on read, and it is part
of the store's salt, so workers with another dtype, block size or tensor layout never share
(or misread) blocks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from deepinfer.core.prefix_hash import BlockHash, salt_hash

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1,
                "float8_e5m2": 1, "int8": 1, "uint8": 1}

# The paged cache's block, as gathered from kv[layer, K|V, kv_head, block_id, slot, head_dim].
PAGED_CACHE_AXES = ("layer", "kv", "head", "slot", "dim")


@dataclass(frozen=True)
class KVBlockLayout:
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    shape: tuple[int, ...]
    axes: tuple[str, ...] = PAGED_CACHE_AXES

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPE_BYTES:
            raise ValueError(f"unsupported KV dtype {self.dtype!r}; one of {sorted(_DTYPE_BYTES)}")
        if len(self.shape) != len(self.axes) or any(d < 1 for d in self.shape):
            raise ValueError(f"shape {self.shape} does not match axes {self.axes}")
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))

    @classmethod
    def for_paged_cache(cls, num_layers: int, num_kv_heads: int, block_size: int,
                        head_dim: int, dtype: str) -> KVBlockLayout:
        """A block of the engine's paged cache: [num_layers, 2, num_kv_heads, block_size, head_dim]."""
        return cls(dtype, (num_layers, 2, num_kv_heads, block_size, head_dim), PAGED_CACHE_AXES)

    @property
    def block_size(self) -> int:
        return self.shape[self.axes.index("slot")]

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * _DTYPE_BYTES[self.dtype]

    @property
    def descriptor(self) -> str:
        """e.g. 'layer,kv,head,slot,dim:float16:30x2x3x16x64'."""
        return f"{','.join(self.axes)}:{self.dtype}:{'x'.join(map(str, self.shape))}"

    def store_salt(self, model_id: str) -> BlockHash:
        """The namespace of this model's blocks in a shared store. `model_id` must identify
        the weights, not a name (serving uses `cluster.prefix_store_tier.store_salt`, which
        salts with the weights' fingerprint)."""
        return salt_hash(model_id, self.dtype, str(self.block_size), self.descriptor)
