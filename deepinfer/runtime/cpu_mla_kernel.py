"""Calls the C MLA decode kernel (kernels/mla_decode.c): absorbed-form decode attention over
the paged latent cache, read through the block table.

The torch path (`PagedMLAAttention._decode` without a kernel) gathers every block of every
sequence into a padded [B, ctx, r + rope] copy and runs SDPA with the one latent "head"
expanded to all H query heads plus a padding mask. The kernel reads each latent entry once per
(sequence, head group) task and keeps the softmax online in float32; W_UV is still applied
after it, in torch. On by default on CPU; DEEPINFER_MLA_KERNEL=0 keeps the torch path.

At load, each dtype is checked against gather + SDPA in float32 on a few shapes (widths that
are not multiples of the vector length, block size 1, lengths 1 and on block boundaries, 1
and N threads); a dtype that disagrees stays on the torch path (cpu_kernel_build.self_test).

Tolerance. The kernel and SDPA sum the same float32 products in other orders, so float32
results differ by a few float32 ulps of the magnitudes summed (scores of |q||k| ~ 10^2 here:
~1e-5 relative after the softmax); bf16 outputs are each rounded once from float32 values
that close, so they differ by at most one bf16 step (2^-8 relative) where a value lies near a
rounding boundary.
"""
from __future__ import annotations

import ctypes
import functools
import os

import torch
import torch.nn.functional as F
from torch import Tensor

from deepinfer.runtime.cpu_kernel_build import (bind_per_dtype, load_kernel_library, mismatch,
                                                 self_test)

_ARGTYPES = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int]
_SYMBOLS = {torch.bfloat16: "mla_decode_bf16", torch.float32: "mla_decode_f32"}
ISA_NAMES = {0: "portable", 1: "avx2"}
# |kernel - reference| <= atol + rtol |reference|, reference in float32 (see the docstring).
TOLERANCE = {torch.bfloat16: (2 ** -7, 2 ** -7), torch.float32: (1e-5, 1e-5)}
# (heads, rank, rope, block size): odd widths and tails of the 8- and 16-wide tiles, block
# size 1, more heads than one task takes (MAX_GROUP = 32).
_SELF_TEST_SHAPES = [(3, 20, 5, 5), (16, 64, 16, 16), (5, 33, 7, 1), (40, 24, 8, 3),
                     (2, 512, 64, 16)]


def enabled() -> bool:
    return os.environ.get("DEEPINFER_MLA_KERNEL", "1") != "0"


class MLADecodeKernel:
    def __init__(self, lib: ctypes.CDLL,
                 dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float32)) -> None:
        self._fns = bind_per_dtype(lib, _SYMBOLS, dtypes, _ARGTYPES)
        lib.mla_decode_isa.restype = ctypes.c_int
        self.isa_name = ISA_NAMES[lib.mla_decode_isa()]
        self._lib = lib

    def supports(self, dtype: torch.dtype, device: torch.device) -> bool:
        return device.type == "cpu" and dtype in self._fns

    def __call__(self, query: Tensor, entries: Tensor, tables: Tensor, lens: Tensor, rank: int,
                 scale: float, num_threads: int | None = None) -> Tensor:
        """query [B, H, r + rope], entries [blocks, BS, r + rope] (same dtype, contiguous),
        tables [B, W] int64, lens [B] int64 -> o_latent [B, H, r]."""
        num, num_heads, dim = query.shape
        _, block_size, entry_dim = entries.shape
        if (entry_dim != dim or entries.dtype != query.dtype or not entries.is_contiguous()
                or not 0 < rank <= dim):
            raise ValueError("MLA decode kernel: query and cache shapes or dtypes disagree")
        query = query.contiguous()
        tables = tables.to(torch.int64).contiguous()
        lens = lens.to(torch.int64).contiguous()
        out = query.new_empty(num, num_heads, rank)
        rc = self._fns[query.dtype](
            query.data_ptr(), entries.data_ptr(), tables.data_ptr(), lens.data_ptr(),
            out.data_ptr(), num, num_heads, dim, rank, block_size, tables.shape[1], scale,
            num_threads or torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"MLA decode kernel failed (code {rc})")
        return out


def reference_mla_decode(query: Tensor, entries: Tensor, tables: Tensor, lens: Tensor, rank: int,
                         scale: float) -> Tensor:
    """The torch gather + SDPA result (the math of `mla_absorbed`, before W_UV) in float32,
    or float64 for float64 inputs."""
    num, num_heads, dim = query.shape
    work = torch.promote_types(query.dtype, torch.float32)
    gathered = entries.index_select(0, tables.reshape(-1)).view(num, -1, dim).to(work)  # [B, C, D]
    mask = (torch.arange(gathered.shape[1]) < lens[:, None])[:, None, None, :]
    keys = gathered.unsqueeze(1).expand(-1, num_heads, -1, -1)
    out = F.scaled_dot_product_attention(query.to(work).unsqueeze(2), keys, keys[..., :rank],
                                         attn_mask=mask, scale=scale)  # [B, H, 1, r]
    return out[:, :, 0]


def random_case(num_heads: int, rank: int, rope: int, block_size: int, lens: list[int],
                dtype: torch.dtype, gen: torch.Generator):
    """A scattered block table over a random cache: (query, entries, tables, lens, scale).
    Entries ~ N(0, 1) as the normalised latent is; queries scaled so that scores spread over
    a few units after the softmax scale (some heads peaked, some flat)."""
    dim = rank + rope
    width = -(-max(lens) // block_size)
    num_blocks = len(lens) * width + 3
    entries = torch.randn(num_blocks, block_size, dim, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen)[:len(lens) * width].view(len(lens), width)
    query = (3 * torch.randn(len(lens), num_heads, dim, generator=gen)).to(dtype)
    return query, entries, tables, torch.tensor(lens, dtype=torch.int64), dim ** -0.5


def kernel_mismatch(kernel: MLADecodeKernel, dtype: torch.dtype) -> str | None:
    """First disagreement of `kernel` with reference_mla_decode for `dtype`, or None."""
    gen = torch.Generator().manual_seed(0)
    threads = sorted({1, torch.get_num_threads()})
    rtol, atol = TOLERANCE[dtype]
    for num_heads, rank, rope, block_size in _SELF_TEST_SHAPES:
        full = -(-40 // block_size) * block_size
        lens = [1, block_size, min(block_size + 1, full), full, 1 + full // 2]
        query, entries, tables, lens_t, scale = random_case(num_heads, rank, rope, block_size,
                                                            lens, dtype, gen)
        want = reference_mla_decode(query, entries, tables, lens_t, rank, scale)
        for num_threads in threads:
            got = kernel(query, entries, tables, lens_t, rank, scale, num_threads)
            case = (f"{dtype}, heads={num_heads}, rank={rank}, rope={rope}, "
                    f"block_size={block_size}, threads={num_threads}")
            problem = mismatch(got, want, rtol, atol, case)
            if problem is not None:
                return problem
    return None


@functools.lru_cache(maxsize=1)
def _load() -> MLADecodeKernel | None:
    lib = load_kernel_library("mla_decode")
    if lib is None:
        return None
    kernel = MLADecodeKernel(lib)
    with torch.inference_mode():
        good = tuple(dtype for dtype in _SYMBOLS if self_test(
            lib, f"{_SYMBOLS[dtype]}[{kernel.isa_name}]",
            lambda dtype=dtype: kernel_mismatch(kernel, dtype)))
    return MLADecodeKernel(lib, good) if good else None


def load_mla_kernel() -> MLADecodeKernel | None:
    """The verified kernel, or None (disabled, no compiler, or it disagrees with torch)."""
    return _load() if enabled() else None
