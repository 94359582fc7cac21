"""Quantized linear layers on CPU: the C kernels of kernels/quant_linear.c behind
`QuantizedLinear` (deepinfer/quant), for every format of the weight contract.

bf16 activations are quantized per step to int8 (a scale per 32 values for GGUF weights, per
row for int8 weights) and dotted with AVX-512 VNNI, AVX2 or portable code; fp8 weights meet
bf16 activations in bf16 dot products (AVX-512) or float32 FMAs on e4m3 codes widened through
F16C (AVX2); float32 activations take the exact path (weights
dequantized row by row inside the kernel, no activation rounding). The instruction set is
the best one the build has; DEEPINFER_QUANT_ISA=avx512|avx2|portable caps it (the AVX2 and
portable paths run on any x86-64 with those instructions and are tested on this one).

At load the kernel is checked against torch on every format (odd widths, partial blocks and
groups, 1..13 rows, bias on and off, 1 and N threads, bf16 and float32 inputs), with the
activation rounding the kernel uses applied on the torch side too, so the comparison is tight;
a disagreement logs one warning and `QuantizedLinear` keeps its reference path.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
import weakref

import torch
import torch.nn.functional as F
from torch import Tensor

from deepinfer.quant.quantized_weight import FP8_BLOCK, GGUF_BLOCKS, INT8, QuantizedWeight
from deepinfer.runtime.cpu_kernel_build import load_kernel_library, self_test

FORMAT_CODES = {"bf16": 0, "q4_0": 1, "q4_1": 2, "q8_0": 3, "q4_k": 4, "q5_k": 5, "q6_k": 6,
                FP8_BLOCK: 7, INT8: 8}
ISA_CODES = {"portable": 0, "avx2": 1, "avx512": 2}
_P, _INT, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
logger = logging.getLogger(__name__)


def requested_isa() -> int:
    """The cap from DEEPINFER_QUANT_ISA (unset: the best the build has)."""
    name = os.environ.get("DEEPINFER_QUANT_ISA", "avx512").strip().lower()
    if name not in ISA_CODES:
        raise ValueError(f"DEEPINFER_QUANT_ISA must be one of {', '.join(ISA_CODES)}, got {name!r}")
    return ISA_CODES[name]


def weight_descriptor(weight: QuantizedWeight) -> Tensor:
    """The 8 x int64 descriptor the C kernels read (kernels/quant_formats.h)."""
    scale = 0 if weight.scale is None else weight.scale.data_ptr()
    return torch.tensor([FORMAT_CODES[weight.format], weight.out_features, weight.in_features,
                         weight.data.data_ptr(), scale, 0, 0, 0], dtype=torch.int64)


def kernel_takes(weight: QuantizedWeight) -> bool:
    """The kernels read contiguous CPU tensors in the contract's dtypes."""
    return (weight.device.type == "cpu" and weight.data.is_contiguous()
            and (weight.scale is None or weight.scale.is_contiguous())
            and (weight.format not in (FP8_BLOCK,) or tuple(weight.block) == (128, 128)))


class QuantLinearKernel:
    """The `QuantKernel` of `QuantizedLinear` (see deepinfer/quant/quantized_linear.py)."""

    def __init__(self, lib: ctypes.CDLL, isa: int) -> None:
        self._fn = lib.quant_linear
        self._fn.argtypes = [_P, _INT, _P, _INT, _I64, _INT, _P, _P, _INT, _INT, _INT]
        self._fn.restype = _INT
        self._rows = lib.quant_dequant_rows
        self._rows.argtypes = [_P, _P, _INT, _P, _INT, _INT]
        self._rows.restype = _INT
        lib.quant_isa_compiled.restype = _INT
        self.isa = min(isa, lib.quant_isa_compiled())
        self.isa_name = {v: k for k, v in ISA_CODES.items()}[self.isa]
        self._descs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # False: prefill rows run in decode-sized chunks (the same bits, slower; benchmarks)
        self.prefill_tiles = True

    def descriptor(self, weight: QuantizedWeight) -> Tensor:
        desc = self._descs.get(weight)
        if desc is None:
            desc = self._descs[weight] = weight_descriptor(weight)
        return desc

    def _run(self, x: Tensor, weight: QuantizedWeight, bias: Tensor | None, out: Tensor) -> None:
        rc = self._fn(self.descriptor(weight).data_ptr(), self.isa, x.data_ptr(),
                      int(x.dtype == torch.float32), x.stride(0), x.shape[0],
                      0 if bias is None else bias.data_ptr(), out.data_ptr(),
                      int(out.dtype == torch.float32), torch.get_num_threads(),
                      int(not self.prefill_tiles))
        if rc != 0:
            raise RuntimeError(f"quantized linear kernel failed (code {rc})")

    @staticmethod
    def _takes(x: Tensor, weight: QuantizedWeight, bias: Tensor | None) -> bool:
        return (x.dim() == 2 and x.shape[0] >= 1 and x.dtype in (torch.bfloat16, torch.float32)
                and x.device.type == "cpu" and x.stride(1) == 1 and x.shape[1] == weight.in_features
                and kernel_takes(weight)
                and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous())))

    def linear(self, x: Tensor, weight: QuantizedWeight, bias: Tensor | None) -> Tensor | None:
        """x [M, in] bf16 or float32 -> [M, out] in x.dtype; None if the kernel does not take x."""
        if not self._takes(x, weight, bias):
            return None
        out = torch.empty(x.shape[0], weight.out_features, dtype=x.dtype)
        self._run(x, weight, bias, out)
        return out

    def dots_f32(self, x: Tensor, weight: QuantizedWeight) -> Tensor | None:
        """x [M, in] -> x @ W.T in float32, not rounded (an LM head's logits)."""
        if not self._takes(x, weight, None):
            return None
        out = torch.empty(x.shape[0], weight.out_features, dtype=torch.float32)
        self._run(x, weight, None, out)
        return out

    def dequantize_rows(self, weight: QuantizedWeight, row_ids: Tensor, dtype: torch.dtype) -> Tensor:
        """Rows `row_ids` of W as `dtype` (bf16 or float32): embedding lookups."""
        ids = row_ids.to(torch.int64).contiguous()
        out = torch.empty(ids.numel(), weight.in_features, dtype=dtype)
        rc = self._rows(self.descriptor(weight).data_ptr(), ids.data_ptr(), ids.numel(),
                        out.data_ptr(), int(dtype == torch.bfloat16), torch.get_num_threads())
        if rc == 1:
            raise IndexError("row id out of range of the quantized table")
        if rc != 0:
            raise RuntimeError(f"quantized row lookup failed (code {rc})")
        return out


# ---- the torch side of the self-test -------------------------------------------------------

def quantized_activations(x: Tensor, fmt: str) -> tuple[Tensor, Tensor]:
    """The activations the kernel computes with for bf16 input `x` [M, K], in float32 (GGUF
    weights see int8 per 32 values, int8 weights int8 per row, fp8 weights bf16 as is), and
    each row's largest int8 step [M] (0 for fp8)."""
    x = x.float()
    num, cols = x.shape
    if fmt == FP8_BLOCK:
        return x, torch.zeros(num)
    width = 32 if fmt in GGUF_BLOCKS else -(-cols // 32) * 32
    padded = F.pad(x, (0, -(-cols // width) * width - cols)).view(num, -1, width)
    amax = padded.abs().amax(dim=2, keepdim=True)
    # tensor / tensor: correctly rounded (torch computes `127.0 / amax` as 127 * (1 / amax),
    # two roundings, which moves the many bf16 values at exactly max|x| / 2 off their tie)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(padded * inv).clamp(-127, 127)
    return (q * (amax / 127.0)).view(num, -1)[:, :cols], amax.view(num, -1).amax(dim=1) / 127.0


# float16 scale fields per GGUF format and their size: max |w| ~ 0.1-0.25 for every format
_SCALE_FIELDS = {"q4_0": ((0,), 2.0 ** -7), "q4_1": ((0, 2), 2.0 ** -7), "q8_0": ((0,), 2.0 ** -10),
                 "q4_k": ((0, 2), 2.0 ** -14), "q5_k": ((0, 2), 2.0 ** -15),
                 "q6_k": ((208,), 2.0 ** -15)}


def random_blocks(fmt: str, rows: int, cols: int, gen: torch.Generator) -> QuantizedWeight:
    """Random valid weights (max |w| around 0.1-0.25): any byte is a valid code; the float16
    scales set to sane values."""
    if fmt == INT8:
        data = torch.randint(-127, 128, (rows, cols), generator=gen, dtype=torch.int8)
        return QuantizedWeight(INT8, rows, cols, data, torch.rand(rows, generator=gen) / 1024)
    if fmt == FP8_BLOCK:
        data = (torch.randn(rows, cols, generator=gen) * 64).to(torch.float8_e4m3fn)
        scale = torch.rand(-(-rows // 128), -(-cols // 128), generator=gen) / 2048
        return QuantizedWeight(FP8_BLOCK, rows, cols, data, scale, (128, 128))
    values, size = GGUF_BLOCKS[fmt]
    blocks = torch.randint(0, 256, (rows * cols // values, size), generator=gen, dtype=torch.uint8)
    offsets, scale = _SCALE_FIELDS[fmt]
    for at in offsets:
        halves = (torch.rand(blocks.shape[0], generator=gen) * scale + scale / 4).half()
        blocks[:, at:at + 2] = halves.view(torch.uint8).view(-1, 2)
    return QuantizedWeight(fmt, rows, cols, blocks.view(rows, -1).contiguous())


# (format, out, in): whole and partial 4-block groups, one-block rows, partial fp8 tiles.
_SELF_TEST_SHAPES = [(fmt, 33, k) for fmt in ("q4_0", "q4_1", "q8_0") for k in (32, 96, 576)]
_SELF_TEST_SHAPES += [(fmt, 17, k) for fmt in ("q4_k", "q5_k", "q6_k") for k in (256, 768)]
_SELF_TEST_SHAPES += [(INT8, 21, 100), (INT8, 9, 576), (FP8_BLOCK, 130, 200), (FP8_BLOCK, 5, 128)]
_SELF_TEST_ROWS = (1, 3, 8, 13)


def _bound(x: Tensor, w: Tensor, want: Tensor, out_dtype: torch.dtype, slack: Tensor) -> Tensor:
    """Allowed |kernel - torch|: float32 sums in another order, one bf16 rounding of a bf16
    output, and `slack` (one int8 step of activation, for a tie rounded the other way)."""
    terms = x.abs().double() @ w.abs().double().T  # [M, N] sum of |products|
    tol = 1e-5 * terms.float() + slack
    return tol if out_dtype == torch.float32 else tol + 2 ** -8 * want.abs()


def quant_linear_mismatch(kernel: QuantLinearKernel) -> str | None:
    """First disagreement of the kernel with torch, or None."""
    gen = torch.Generator().manual_seed(0)
    old_threads = torch.get_num_threads()
    try:
        for fmt, out_features, in_features in _SELF_TEST_SHAPES:
            weight = random_blocks(fmt, out_features, in_features, gen)
            w = weight.dequantize(torch.float32)
            for num_threads in sorted({1, old_threads}):
                torch.set_num_threads(num_threads)
                for rows in _SELF_TEST_ROWS:
                    problem = _check_case(kernel, weight, w, rows, gen, f"{fmt} [{out_features}, "
                                          f"{in_features}] rows={rows} threads={num_threads}")
                    if problem is not None:
                        return problem
    finally:
        torch.set_num_threads(old_threads)
    return None


def _check_case(kernel, weight, w, rows, gen, case) -> str | None:
    x = torch.randn(rows, weight.in_features, generator=gen)
    bias = torch.randn(weight.out_features, generator=gen)
    for dtype in (torch.bfloat16, torch.float32):
        xd, bd = x.to(dtype), bias.to(dtype)
        if dtype == torch.bfloat16:  # one int8 step of one value may round the other way
            xq, step = quantized_activations(xd, weight.format)
            slack = step[:, None] * w.abs().amax(dim=1)[None, :] * 1.01
        else:
            xq, slack = xd.float(), torch.zeros(())
        for b in (None, bd):
            got = kernel.linear(xd, weight, b)
            want = xq @ w.T + (0 if b is None else b.float())
            if got is None:
                return f"{case}: the kernel did not take a {dtype} input"
            err = (got.float() - want).abs()
            bad = err > _bound(xq, w, want, dtype, slack)
            if bad.any():
                return (f"{case} {dtype} bias={b is not None}: {int(bad.sum())} of {err.numel()} "
                        f"values off, max error {err.max().item():.3g}")
        if dtype == torch.bfloat16:
            got = kernel.dots_f32(xd, weight)
            want = xq @ w.T
            err = (got - want).abs()
            if (err > _bound(xq, w, want, torch.float32, slack)).any():
                return f"{case}: float32 dots off by {err.max().item():.3g}"
    ids = torch.tensor([weight.out_features - 1, 0])
    for dtype, rtol in ((torch.float32, 1e-6), (torch.bfloat16, 2 ** -7)):
        # float32: the kernel may fuse d * q + m into one rounding where torch rounds twice
        got = kernel.dequantize_rows(weight, ids, dtype).float()
        if not torch.allclose(got, w[ids], rtol=rtol, atol=1e-6 * w.abs().max().item()):
            return f"{case}: row lookup ({dtype}) differs from the reference dequantize"
    return None


@functools.lru_cache(maxsize=4)
def _load(isa: int) -> QuantLinearKernel | None:
    lib = load_kernel_library("quant_linear")
    if lib is None:
        return None
    kernel = QuantLinearKernel(lib, isa)
    with torch.inference_mode():
        ok = self_test(lib, f"quant_linear[{kernel.isa_name}]", lambda: quant_linear_mismatch(kernel))
    return kernel if ok else None


def load_quant_linear() -> QuantLinearKernel | None:
    """The verified kernel for DEEPINFER_QUANT_ISA (or the best ISA), or None."""
    return _load(requested_isa())


def install_quant_kernels(model: torch.nn.Module) -> int:
    """Give every quantized CPU layer of `model` the verified kernel; returns how many (0 when
    the kernel is unavailable: the layers keep their reference path)."""
    from deepinfer.models.quantized_model import quantized_modules

    targets = [m for m in quantized_modules(model)
               if all(kernel_takes(p) for p in m.parts)]
    if not targets:
        return 0
    kernel = load_quant_linear()
    if kernel is None:
        return 0
    for module in targets:
        module.kernel = kernel
    logger.info("quantized kernels (%s) in %d layers", kernel.isa_name, len(targets))
    return len(targets)
