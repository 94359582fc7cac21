"""Calls the C causal prefill-attention kernel (kernels/prefill_attention.c).

A prefill chunk of x tokens after P cached ones attends over the cache in place, through its
block table: no per-layer gather of the prefix, no [x, P + x] mask, the query heads that share a
KV head in one pass, bf16 dot products (vdpbf16ps) with an fp32 online softmax. torch's SDPA
reached ~33 GFLOP/s on 512-token prefills of the default model (9 heads of 64, GQA 3:1) on
Zen 4; see benchmarks/prefill_attention_bench.py for the kernel's figure.

Used for bf16 caches with head_dim a multiple of 32 (up to 256) and at most 16 query heads per KV
head, on CPUs with AVX-512 BF16; anything else stays on SDPA. DEEPINFER_PREFILL_KERNEL=0 keeps
SDPA for every chunk. At load the kernel is checked against SDPA (float32) on a few shapes, at
1 and N threads; a disagreement keeps SDPA (see cpu_kernel_build.self_test). Like the decode
kernel it runs in torch's own OpenMP pool (its libgomp resolves to the copy torch loaded).
"""
from __future__ import annotations

import ctypes
import os

import torch
import torch.nn.functional as F
from torch import Tensor

from deepinfer.runtime.cpu_kernel_build import load_kernel_library, mismatch, self_test

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_ARGTYPES = [_P, _I64, _P, _P, _P, _I64, _I64, _I64, _INT, _P, _I64, _INT, _INT, _INT, _INT, _INT,
             ctypes.c_float, _INT]
MAX_GROUP = 16  # the kernel's MAX_G
MAX_HEAD_DIM = 256
# bf16 output of an fp32 softmax whose probabilities are rounded to bf16 for P.V: a few bf16
# steps of the output's magnitude (~1 for unit-variance V).
TOLERANCE = 2e-2
# (x, P, kv heads, group, head dim, block size): a tail tile, a prefix that ends mid-block,
# each BQ (group <= 2: 48 rows, else 16), head dims 32/64/128.
_SELF_TEST_SHAPES = [(17, 0, 1, 3, 64, 16), (50, 21, 2, 1, 32, 8), (33, 70, 1, 8, 128, 16),
                     (5, 3, 2, 2, 64, 4)]


class PrefillKernel:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.prefill_attention_bf16
        self._fn.argtypes = _ARGTYPES
        self._fn.restype = _INT
        self._flat_table = torch.zeros(1, dtype=torch.long)

    @staticmethod
    def supports(dtype: torch.dtype, head_dim: int, num_heads: int, num_kv_heads: int) -> bool:
        return (dtype == torch.bfloat16 and head_dim % 32 == 0 and head_dim <= MAX_HEAD_DIM
                and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= MAX_GROUP)

    def paged(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, block_ids: Tensor,
              num_cached: int, out: Tensor, num_threads: int) -> None:
        """q, out [x, H, d] (token-strided views); caches [blocks, bs, KV, d]; block_ids [n]
        long covering the P = num_cached prefix and the chunk, whose K/V are already written."""
        _, block_size, num_kv_heads, head_dim = k_cache.shape
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("the prefill kernel reads contiguous [blocks, bs, KV, d] caches")
        row = num_kv_heads * head_dim
        self._run(q, k_cache, v_cache, block_ids, block_size * row, row, row, block_size, out,
                  num_cached, num_kv_heads, num_threads)

    def flat(self, q: Tensor, k: Tensor, v: Tensor, out: Tensor, num_threads: int) -> None:
        """A chunk with no prefix: q, out [x, H, d]; k, v [x, KV, d] (token-strided views)."""
        k = k if _rows(k) else k.contiguous()
        v = v if _rows(v) else v.contiguous()
        self._run(q, k, v, self._flat_table, 0, k.stride(0), v.stride(0), max(1, q.shape[0]),
                  out, 0, k.shape[1], num_threads)

    def _run(self, q, k, v, table, block_stride, token_stride, v_token_stride, block_size, out,
             num_cached, num_kv_heads, num_threads) -> None:
        x, num_heads, head_dim = q.shape
        if not (q.dtype == k.dtype == v.dtype == out.dtype == torch.bfloat16
                and table.dtype == torch.long and table.is_contiguous()):
            raise ValueError("the prefill kernel takes bf16 q/k/v/out and an int64 block table")
        q = q if _rows(q) else q.contiguous()
        dst = out if _rows(out) else torch.empty_like(out, memory_format=torch.contiguous_format)
        rc = self._fn(q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(), table.data_ptr(),
                      block_stride, token_stride, v_token_stride, block_size, dst.data_ptr(),
                      dst.stride(0), x, num_cached, num_kv_heads, num_heads // num_kv_heads,
                      head_dim, head_dim ** -0.5, num_threads)
        if rc != 0:
            raise RuntimeError(f"prefill attention kernel failed (code {rc})")
        if dst is not out:
            out.copy_(dst)


def _rows(t: Tensor) -> bool:
    """[tokens, heads, d] with each token's heads packed (any token stride): what the kernel reads."""
    return t.stride(2) == 1 and t.stride(1) == t.shape[2]


def reference_prefill(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_ids: Tensor,
                      num_cached: int) -> Tensor:
    """Gather + causal-with-offset SDPA in float32: [x, H, d]."""
    x, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    ctx = num_cached + x
    keys = k_cache.index_select(0, block_ids).view(-1, num_kv_heads, head_dim)[:ctx]
    values = v_cache.index_select(0, block_ids).view(-1, num_kv_heads, head_dim)[:ctx]
    mask = torch.arange(ctx)[None, :] <= torch.arange(num_cached, ctx)[:, None]
    o = F.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None], keys.float().transpose(0, 1)[None],
        values.float().transpose(0, 1)[None], attn_mask=mask,
        enable_gqa=num_heads != num_kv_heads)
    return o[0].transpose(0, 1)


def prefill_kernel_mismatch(kernel: PrefillKernel) -> str | None:
    """First disagreement of the kernel with reference_prefill, or None."""
    gen = torch.Generator().manual_seed(0)
    for x, cached, num_kv_heads, group, head_dim, block_size in _SELF_TEST_SHAPES:
        width = -(-(cached + x) // block_size)
        num_blocks = width + 3
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        k_cache = torch.randn(shape, generator=gen).bfloat16()
        v_cache = torch.randn(shape, generator=gen).bfloat16()
        block_ids = torch.randperm(num_blocks, generator=gen)[:width]
        q = (2 * torch.randn(x, num_kv_heads * group, head_dim, generator=gen)).bfloat16()
        want = reference_prefill(q, k_cache, v_cache, block_ids, cached)
        for num_threads in sorted({1, torch.get_num_threads()}):
            out = torch.empty_like(q)
            kernel.paged(q, k_cache, v_cache, block_ids, cached, out, num_threads)
            case = (f"x={x}, P={cached}, kv_heads={num_kv_heads}, group={group}, "
                    f"head_dim={head_dim}, block_size={block_size}, threads={num_threads}")
            problem = mismatch(out, want, TOLERANCE, TOLERANCE, case)
            if problem is not None:
                return problem
    return None


def enabled() -> bool:
    return os.environ.get("DEEPINFER_PREFILL_KERNEL", "1") != "0"


def load_prefill_kernel() -> PrefillKernel | None:
    """The verified kernel, or None (disabled, no compiler, no AVX-512 BF16, or it disagrees
    with SDPA on this host)."""
    if not enabled():
        return None
    lib = load_kernel_library("prefill_attention")
    if lib is None or not lib.prefill_attention_available():
        return None
    kernel = PrefillKernel(lib)
    ok = self_test(lib, "prefill_attention_bf16", lambda: prefill_kernel_mismatch(kernel))
    return kernel if ok else None
