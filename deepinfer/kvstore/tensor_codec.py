"""Torch adapter for the byte-level store: one KV block tensor <-> payload bytes.

The payload is the tensor's raw memory in C order (no pickling), so it is as large as the
block and decodes with one copy. Any dtype works, bfloat16 included (numpy has none: the
bytes go through a uint8 view).
"""
from __future__ import annotations

import torch

from deepinfer.kvstore.block_layout import KVBlockLayout


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r}")
    return dtype


def layout_of(block: torch.Tensor, axes: tuple[str, ...] | None = None) -> KVBlockLayout:
    """The layout describing `block` (default axes: the paged cache's)."""
    dtype = str(block.dtype).removeprefix("torch.")
    if axes is None:
        return KVBlockLayout(dtype, tuple(block.shape))
    return KVBlockLayout(dtype, tuple(block.shape), axes)


def kv_block_to_bytes(block: torch.Tensor, layout: KVBlockLayout) -> bytes:
    """Serialize one block; its shape and dtype must be the layout's."""
    if tuple(block.shape) != layout.shape or block.dtype != _torch_dtype(layout.dtype):
        raise ValueError(f"block {tuple(block.shape)} {block.dtype} does not match layout "
                         f"{layout.descriptor}")
    flat = block.detach().to("cpu").contiguous().reshape(-1)  # [numel]
    return flat.view(torch.uint8).numpy().tobytes()


def kv_block_from_bytes(payload: bytes | memoryview, layout: KVBlockLayout,
                        device: torch.device | str = "cpu") -> torch.Tensor:
    """The block tensor stored in `payload`, on `device`."""
    if len(payload) != layout.num_bytes:
        raise ValueError(f"payload has {len(payload)} bytes, layout {layout.descriptor} "
                         f"needs {layout.num_bytes}")
    raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)  # [num_bytes], owns a copy
    block = raw.view(_torch_dtype(layout.dtype)).reshape(layout.shape)
    return block.to(device) if str(device) != "cpu" else block
