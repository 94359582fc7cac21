"""Weights on transparent huge pages (Linux, CPU).

A batch-1 decode step streams every weight once (~270 MB for the default model in bf16). On
4 KiB pages that is ~66k pages per token, each needing a TLB entry and, often, a page walk;
2 MiB pages cut that 512-fold. Kernels commonly run THP in `madvise` mode, where only memory
that asks for it gets huge pages, and torch's allocator does not ask. `move_to_huge_pages`
copies a set of tensors into one 2 MiB-aligned anonymous mapping advised MADV_HUGEPAGE
(before it is touched, so the page faults allocate huge pages) and re-points each tensor's
`.data` at its slice: same values, same shapes, fewer TLB misses.
DEEPINFER_HUGE_PAGES=0 keeps torch's allocation.
"""
from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Iterable

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_ALIGN = 4096  # each tensor's start within the arena (GEMV rows need 64; keep page starts)


def enabled() -> bool:
    return os.environ.get("DEEPINFER_HUGE_PAGES", "1") != "0" and hasattr(mmap, "MADV_HUGEPAGE")


def huge_page_arena(nbytes: int) -> Tensor:
    """An untouched uint8 tensor of `nbytes`, 2 MiB-aligned, advised MADV_HUGEPAGE. The
    mapping lives as long as the tensor (or any view of it)."""
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(region, dtype=torch.uint8)  # holds `region`; touches nothing
    start = -whole.data_ptr() % HUGE_PAGE
    length = (nbytes + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    region.madvise(mmap.MADV_HUGEPAGE, start, min(length, len(region) - start))
    return whole[start:start + nbytes]


def move_to_huge_pages(tensors: Iterable[Tensor]) -> int:
    """Copy each contiguous CPU tensor (Parameters included) into one huge-page arena and point
    its `.data` there; tensors sharing a storage are moved once. Returns the bytes moved (0
    when disabled or on failure, leaving every tensor where it was)."""
    if not enabled():
        return 0
    unique: dict[int, Tensor] = {}
    for t in tensors:
        if t.device.type == "cpu" and t.is_contiguous() and t.numel() > 0:
            unique.setdefault(t.data_ptr(), t)
    if not unique:
        return 0
    offsets, total = [], 0
    for t in unique.values():
        offsets.append(total)
        total += (t.numel() * t.element_size() + _ALIGN - 1) // _ALIGN * _ALIGN
    try:
        arena = huge_page_arena(total)
    except (OSError, ValueError, RuntimeError) as e:
        logger.info("huge-page arena unavailable (%s): weights stay where they are", e)
        return 0
    # Aliases of one storage by other tensor objects (a detached copy) would keep the old memory:
    # callers move tensors before handing out aliases (see pack_linear_weights).
    with torch.no_grad():
        for t, offset in zip(unique.values(), offsets):
            nbytes = t.numel() * t.element_size()
            moved = arena[offset:offset + nbytes].view(t.dtype).view(t.shape)
            moved.copy_(t)
            t.data = moved
    return total


def huge_page_bytes() -> int:
    """AnonHugePages of this process in bytes (/proc/self/smaps_rollup), or -1 if unknown."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return -1
