"""Calls the C paged-decode-attention kernel (kernels/paged_decode_attention.c).

The kernel reads K/V straight from the block table, so decode attention skips the gather
copy and the boolean mask. On by default (DEEPINFER_DECODE_KERNEL=0 keeps the torch gather +
SDPA path, the reference). It runs in torch's own OpenMP pool: the library links libgomp.so.1,
which the loader resolves to the copy torch already loaded (checked in /proc/self/maps), so
there is one thread pool, not two. Measured per layer, CPU time on a loaded Zen 4 box, one
thread (benchmarks/perf_step_profile.py and a layer micro-benchmark): B=1, ctx=300: 96 -> 52 us;
B=64, ctx=320: 17.5 -> 6.8 ms. (An earlier W1 run on a shared Sapphire Rapids box was ~20%
slower with the kernel, 23.5 s vs 19.5 s; not reproduced per step here, to be re-measured.)

At load, each dtype of the kernel is checked against gather + SDPA on a few shapes (odd
head dims, block sizes and lengths, 1 and N threads); a dtype that disagrees stays on the
torch path (see cpu_kernel_build.self_test).
"""
from __future__ import annotations

import ctypes
import os

import torch
import torch.nn.functional as F

from deepinfer.runtime.cpu_kernel_build import (bind_per_dtype, load_kernel_library, mismatch,
                                                 self_test)

_ARGTYPES = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int]
_SYMBOLS = {torch.bfloat16: "paged_decode_attention_bf16",
            torch.float32: "paged_decode_attention_f32"}
_TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 1e-4}
# (kv heads, query heads per kv head, head dim, block size): widths that are not multiples
# of the vector length, block size 1, the largest group the kernel takes.
_SELF_TEST_SHAPES = [(2, 3, 17, 5), (1, 8, 64, 16), (3, 1, 128, 1), (2, 4, 80, 16),
                     (1, 32, 24, 3), (1, 2, 256, 16)]


class DecodeKernel:
    def __init__(self, lib: ctypes.CDLL,
                 dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float32)) -> None:
        self._fns = bind_per_dtype(lib, _SYMBOLS, dtypes, _ARGTYPES)

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


def reference_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     tables: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """The torch gather + SDPA result in float32, for the self-test."""
    num, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    k = k_cache.index_select(0, tables.reshape(-1)).view(num, -1, num_kv_heads, head_dim)
    v = v_cache.index_select(0, tables.reshape(-1)).view(num, -1, num_kv_heads, head_dim)
    mask = (torch.arange(k.shape[1]) < lens[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(
        q.view(num, num_kv_heads, -1, head_dim).float(), k.transpose(1, 2).float(),
        v.transpose(1, 2).float(), attn_mask=mask)
    return out.reshape(num, num_heads, head_dim)


def decode_kernel_mismatch(kernel: DecodeKernel, dtype: torch.dtype) -> str | None:
    """First disagreement of `kernel` with reference_decode for `dtype`, or None."""
    gen = torch.Generator().manual_seed(0)
    threads = sorted({1, torch.get_num_threads()})
    for num_kv_heads, group, head_dim, block_size in _SELF_TEST_SHAPES:
        width = -(-40 // block_size)  # up to 40 tokens per sequence
        num_blocks = 5 * width + 3
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        k_cache = torch.randn(shape, generator=gen).to(dtype)
        v_cache = torch.randn(shape, generator=gen).to(dtype)
        tables = torch.randperm(num_blocks, generator=gen)[:5 * width].view(5, width)
        full = width * block_size
        lens = torch.tensor([1, block_size, min(block_size + 1, full), full, 1 + full // 2])
        q = (2 * torch.randn(5, num_kv_heads * group, head_dim, generator=gen)).to(dtype)
        want = reference_decode(q, k_cache, v_cache, tables, lens)
        for num_threads in threads:
            got = kernel(q, k_cache, v_cache, tables, lens, num_threads)
            case = (f"{dtype}, kv_heads={num_kv_heads}, group={group}, head_dim={head_dim}, "
                    f"block_size={block_size}, threads={num_threads}")
            problem = mismatch(got, want, _TOLERANCE[dtype], _TOLERANCE[dtype], case)
            if problem is not None:
                return problem
    return None


def load_decode_kernel() -> DecodeKernel | None:
    if os.environ.get("DEEPINFER_DECODE_KERNEL", "1") == "0":
        return None
    lib = load_kernel_library("paged_decode_attention")
    if lib is None:
        return None
    kernel = DecodeKernel(lib)
    good = tuple(dtype for dtype in _SYMBOLS if self_test(
        lib, _SYMBOLS[dtype], lambda dtype=dtype: decode_kernel_mismatch(kernel, dtype)))
    return DecodeKernel(lib, good) if good else None
