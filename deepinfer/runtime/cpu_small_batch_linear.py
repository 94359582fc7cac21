"""bf16 linear layers for decode-sized batches on CPU (kernels/small_batch_linear.c).

oneDNN's packed GEMM is the right tool for many rows, but at 1..8 rows (batch-1 and small-batch
decode) it reads the weights well below memory speed; the C kernel streams each weight row
once and dots it with every input row. `cpu_linear_packing.PackedLinear` routes inputs of at
most `MAX_ROWS` rows here when the kernel is loaded and passed its self-test against F.linear
(odd widths, tails that are not a multiple of the vector length, bias or not, 1..MAX_ROWS
rows, 1 and N threads). DEEPINFER_SMALL_BATCH_LINEAR=0 keeps oneDNN for every batch.
`dots_f32` is the same GEMV left in float32 (no bf16 rounding): the LM head's logits at
1..MAX_ROWS rows (models/llama.compute_logits via PackedLinear.logits_f32).
"""
from __future__ import annotations

import ctypes
import functools
import os

import torch
import torch.nn.functional as F
from torch import Tensor

from deepinfer.runtime.cpu_kernel_build import load_kernel_library, mismatch, self_test

MAX_ROWS = 8  # the kernel's MAX_M
_P, _INT = ctypes.c_void_p, ctypes.c_int
# (N, K): a single output, widths below / at / above the 32-wide vector, the model's shapes.
_SELF_TEST_SHAPES = [(1, 1), (17, 31), (33, 32), (64, 33), (70, 100), (300, 576), (129, 1536)]
_TOL = 1e-2  # one bf16 rounding of a float32 sum on each side
_TOL_F32 = 1e-4  # fp32 sums in another order (K <= 1536 products of unit scale)


class SmallBatchLinear:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.small_batch_linear_bf16
        self._fn.argtypes = [_P, _P, _P, _P, _INT, _INT, _INT, _INT]
        self._fn.restype = _INT
        self._dots_f32 = lib.small_batch_dots_f32
        self._dots_f32.argtypes = [_P, _P, _P, _INT, _INT, _INT, _INT]
        self._dots_f32.restype = _INT
        self.uses_dpbf16 = bool(lib.small_batch_linear_uses_dpbf16())

    @staticmethod
    def applies(x: Tensor, weight: Tensor) -> bool:
        return (x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.dtype == torch.bfloat16
                and weight.dtype == torch.bfloat16 and x.device.type == "cpu"
                and x.is_contiguous() and weight.is_contiguous())

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        """x [M, K] (M <= MAX_ROWS), weight [N, K], bias [N] or None -> [M, N]; all bf16."""
        num, in_features = x.shape
        out_features = weight.shape[0]
        out = torch.empty(num, out_features, dtype=x.dtype)
        rc = self._fn(x.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(),
                      out.data_ptr(), num, out_features, in_features, torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"small-batch linear kernel failed (code {rc})")
        return out

    def dots_f32(self, x: Tensor, weight: Tensor) -> Tensor:
        """x [M, K] (M <= MAX_ROWS), weight [N, K], bf16 -> x @ weight.T [M, N] in float32,
        not rounded to bf16 (the LM head: exact enough to rank the top tokens)."""
        num, in_features = x.shape
        out_features = weight.shape[0]
        out = torch.empty(num, out_features, dtype=torch.float32)
        rc = self._dots_f32(x.data_ptr(), weight.data_ptr(), out.data_ptr(), num, out_features,
                            in_features, torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"small-batch fp32 dots kernel failed (code {rc})")
        return out


def small_batch_linear_mismatch(kernel: SmallBatchLinear) -> str | None:
    """First disagreement of the kernel with F.linear in float32, or None."""
    gen = torch.Generator().manual_seed(0)
    old_threads = torch.get_num_threads()
    try:
        for num_threads in sorted({1, old_threads}):
            torch.set_num_threads(num_threads)
            for out_features, in_features in _SELF_TEST_SHAPES:
                weight = (torch.randn(out_features, in_features, generator=gen)
                          / in_features ** 0.5).bfloat16()
                bias = torch.randn(out_features, generator=gen).bfloat16()
                for rows in (1, 3, MAX_ROWS):
                    x = torch.randn(rows, in_features, generator=gen).bfloat16()
                    for b in (None, bias):
                        want = F.linear(x.float(), weight.float(), None if b is None else b.float())
                        case = (f"rows={rows}, out={out_features}, in={in_features}, "
                                f"bias={b is not None}, threads={num_threads}")
                        problem = mismatch(kernel(x, weight, b), want, _TOL, _TOL, case)
                        if problem is not None:
                            return problem
                    problem = mismatch(kernel.dots_f32(x, weight), F.linear(x.float(), weight.float()),
                                       _TOL_F32, _TOL_F32, f"fp32 dots, {case}")
                    if problem is not None:
                        return problem
    finally:
        torch.set_num_threads(old_threads)
    return None


def enabled() -> bool:
    return os.environ.get("DEEPINFER_SMALL_BATCH_LINEAR", "1") != "0"


@functools.lru_cache(maxsize=1)
def load_small_batch_linear() -> SmallBatchLinear | None:
    """The verified kernel, or None (disabled, no compiler, or it disagrees with torch)."""
    if not enabled():
        return None
    lib = load_kernel_library("small_batch_linear")
    if lib is None:
        return None
    kernel = SmallBatchLinear(lib)
    ok = self_test(lib, "small_batch_linear_bf16", lambda: small_batch_linear_mismatch(kernel))
    return kernel if ok else None
