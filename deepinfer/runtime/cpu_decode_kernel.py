"""Calls the C paged-decode-attention kernel (kernels/paged_decode_attention.c).

The kernel reads K/V straight from the block table, so decode attention skips the gather
copy. Opt-in (DEEPINFER_DECODE_KERNEL=1): alone, one layer's decode attention is faster
(B=64, ctx=320, bf16: 1.50 -> 1.27 ms), but the whole W1 benchmark ran ~20% slower with it
(23.5 s vs 19.5 s, alternating runs), so the torch gather + SDPA path stays the default
until the kernel's threading is understood.
"""
from __future__ import annotations

import ctypes
import os

import torch

from deepinfer.runtime.cpu_kernel_build import load_kernel_library

_ARGTYPES = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int]


class DecodeKernel:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fns = {torch.bfloat16: lib.paged_decode_attention_bf16,
                     torch.float32: lib.paged_decode_attention_f32}
        for fn in self._fns.values():
            fn.argtypes = _ARGTYPES
            fn.restype = ctypes.c_int

    def supports(self, dtype: torch.dtype, device: torch.device) -> bool:
        return device.type == "cpu" and dtype in self._fns

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 tables: torch.Tensor, lens: torch.Tensor, num_threads: int) -> torch.Tensor:
        """q [B, H, d] contiguous; caches [blocks, bs, KV, d]; tables [B, W]; lens [B]."""
        num, num_heads, head_dim = q.shape
        _, block_size, num_kv_heads, _ = k_cache.shape
        out = torch.empty_like(q)
        rc = self._fns[q.dtype](
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
            lens.data_ptr(), out.data_ptr(), num, num_kv_heads, num_heads // num_kv_heads,
            head_dim, block_size, tables.shape[1], head_dim ** -0.5, num_threads)
        if rc != 0:
            raise RuntimeError(f"decode kernel failed (code {rc})")
        return out


def load_decode_kernel() -> DecodeKernel | None:
    if os.environ.get("DEEPINFER_DECODE_KERNEL", "0") != "1":
        return None
    lib = load_kernel_library("paged_decode_attention")
    return None if lib is None else DecodeKernel(lib)
