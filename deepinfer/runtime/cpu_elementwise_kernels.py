"""Fused bf16 RMSNorm, SiLU-and-mul and rotary embedding for CPU (kernels/fused_elementwise.c).

`install_elementwise_kernels(model)` hands the loaded kernels to each bf16 RMSNorm, SwiGLU
MLP and Llama attention (its q/k rotary: one pass instead of torch's eight ops, bit-equal) of a
CPU model (an explicit per-module attribute, no global switch); the modules
fall back to their torch code for any other dtype, device or a non-contiguous input.
Each op is first checked against torch on a few shapes (odd widths, widths that are not a
multiple of the vector length or of the kernel's chunk, serial and threaded row counts,
gates far in both tails); an op that disagrees is not installed (cpu_kernel_build.self_test).
"""
from __future__ import annotations

import ctypes
import itertools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deepinfer.runtime.cpu_kernel_build import load_kernel_library, mismatch, self_test

_P, _I64, _INT, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
# Rows: below and above each kernel's threading threshold (16 and 64 rows).
_SELF_TEST_ROWS = (1, 17, 70)
_SELF_TEST_WIDTHS = (1, 7, 64, 257, 577)
_TOL = 1e-2  # about one bf16 step: inputs are the same bf16 values on both sides


class ElementwiseKernels:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self._rms_norm = lib.rms_norm_bf16
        self._rms_norm.argtypes = [_P, _P, _P, _I64, _INT, _F, _INT]
        self._silu_and_mul = lib.silu_and_mul_bf16
        self._silu_and_mul.argtypes = [_P, _P, _I64, _INT, _INT]
        self._rotary = lib.rotary_bf16
        self._rotary.argtypes = [_P, _I64, _P, _P, _I64, _P, _I64, _INT, _INT, _INT]

    @staticmethod
    def applies(x: Tensor) -> bool:
        return x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.is_contiguous()

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        hidden = x.shape[-1]
        out = torch.empty_like(x)
        self._rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // hidden,
                       hidden, eps, torch.get_num_threads())
        return out

    def silu_and_mul(self, gate_up: Tensor) -> Tensor:
        """gate_up [T, 2I] -> silu(gate) * up [T, I]."""
        num, width = gate_up.shape
        out = torch.empty(num, width // 2, dtype=gate_up.dtype)
        self._silu_and_mul(gate_up.data_ptr(), out.data_ptr(), num, width // 2,
                           torch.get_num_threads())
        return out


    @staticmethod
    def rotary_applies(x: Tensor, cos: Tensor, sin: Tensor) -> bool:
        """x [T, heads, D] with heads adjacent in each row; cos/sin [T, 1, D/2] rows."""
        return (x.dtype == cos.dtype == sin.dtype == torch.bfloat16 and x.device.type == "cpu"
                and x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]
                and x.shape[2] % 2 == 0 and cos.shape == sin.shape == (x.shape[0], 1, x.shape[2] // 2)
                and cos.stride(2) == sin.stride(2) == 1 and cos.stride(0) == sin.stride(0))

    def rotary(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """layers.rotary.apply_rotary for bf16 (same roundings): -> [T, heads, D] contiguous."""
        num, heads, dim = x.shape
        out = torch.empty(num, heads, dim, dtype=x.dtype)
        self._rotary(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), cos.stride(0),
                     out.data_ptr(), num, heads, dim, torch.get_num_threads())
        return out


def rotary_mismatch(kernels: ElementwiseKernels) -> str | None:
    """First difference of the rotary kernel from apply_rotary (bit-equal expected), or None."""
    from deepinfer.layers.rotary import RotaryEmbedding, apply_rotary

    gen = torch.Generator().manual_seed(2)
    for rows in _SELF_TEST_ROWS:
        for heads, dim in ((1, 2), (3, 18), (12, 64), (2, 600)):
            rope = RotaryEmbedding(dim, 512, 10000.0, None, torch.bfloat16)
            cos, sin = rope.cos_sin(torch.randint(0, 512, (rows,), generator=gen))
            # heads taken from wider rows, as the model passes q|k out of the qkv projection
            wide = (3 * torch.randn(rows, heads + 1, dim, generator=gen)).bfloat16()
            x = wide[:, :heads]
            problem = mismatch(kernels.rotary(x, cos, sin), apply_rotary(x, cos, sin), 0.0, 0.0,
                               f"rotary rows={rows}, heads={heads}, head_dim={dim}")
            if problem is not None:
                return problem
    return None


def rms_norm_mismatch(kernels: ElementwiseKernels) -> str | None:
    """First disagreement of the RMSNorm kernel with F.rms_norm in float32, or None."""
    gen = torch.Generator().manual_seed(0)
    for rows in _SELF_TEST_ROWS:
        for width in _SELF_TEST_WIDTHS:
            x = (3 * torch.randn(rows, width, generator=gen)).bfloat16()
            weight = torch.randn(width, generator=gen).bfloat16()
            want = F.rms_norm(x.float(), (width,), weight.float(), 1e-6)
            problem = mismatch(kernels.rms_norm(x, weight, 1e-6), want, _TOL, _TOL,
                               f"rms_norm rows={rows}, width={width}")
            if problem is not None:
                return problem
    return None


def silu_and_mul_mismatch(kernels: ElementwiseKernels) -> str | None:
    """First disagreement of the SiLU-and-mul kernel with F.silu(gate) * up, or None."""
    gen = torch.Generator().manual_seed(1)
    tails = torch.tensor([-1000.0, -100.0, -88.5, 88.5, 100.0])  # exp overflow either way
    for rows in _SELF_TEST_ROWS:
        for width in _SELF_TEST_WIDTHS:
            gate_up = 4 * torch.randn(rows, 2 * width, generator=gen)
            gate_up[0, :min(width, len(tails))] = tails[:width]
            gate_up = gate_up.bfloat16()
            gate, up = gate_up.float().split(width, dim=-1)
            problem = mismatch(kernels.silu_and_mul(gate_up), F.silu(gate) * up, _TOL, _TOL,
                               f"silu_and_mul rows={rows}, width={width}")
            if problem is not None:
                return problem
    return None


def _module_dtype(module: nn.Module, quantized_only: torch.dtype | None = None) -> torch.dtype | None:
    """The dtype of the first parameter or buffer: after cpu_linear_packing an MLP's weights
    are packed buffers (looking at parameters alone missed every packed MLP). Quantized
    weights' codes and scales say nothing about the activations and are skipped; a module
    holding nothing else (a GGUF model's MLP, its bias-free attention) runs in the model's
    activation dtype, `quantized_only`. Without kernels those kept torch's SiLU and rotary
    while the fused decode stack runs the C ones: the two paths rounded apart."""
    from deepinfer.models.quantized_model import quantized_modules

    skip = {id(t) for m in quantized_modules(module) for t in m.buffers()}
    # where oneDNN cannot pack bf16 a PackedLinear holds only its plain weight (an attribute)
    plain = (m.plain_weight for m in module.modules()
             if isinstance(getattr(m, "plain_weight", None), torch.Tensor))
    tensor = next((t for t in itertools.chain(module.parameters(), module.buffers(), plain)
                   if id(t) not in skip), None)
    if tensor is None:
        return quantized_only if quantized_modules(module) else None
    return tensor.dtype


def install_elementwise_kernels(model: nn.Module) -> int:
    """Give the bf16 CPU norms, MLPs and Llama attentions of `model` the fused kernels, and a
    dense Llama model the fused decode stack (runtime.cpu_decode_stack); returns how many
    modules got element-wise kernels."""
    from deepinfer.layers.mlp import SwiGLUMLP
    from deepinfer.layers.norm import RMSNorm
    from deepinfer.models.llama import LlamaAttention

    from deepinfer.runtime.cpu_decode_stack import install_decode_stack

    # The whole-stack decode kernel of a dense Llama model (not counted: not a module kernel).
    install_decode_stack(model)
    targets = [m for m in model.modules() if isinstance(m, (RMSNorm, SwiGLUMLP, LlamaAttention))
               and _module_dtype(m, getattr(model, "dtype", None)) == torch.bfloat16]
    if not targets:
        return 0
    lib = load_kernel_library("fused_elementwise")
    if lib is None:
        return 0
    kernels = ElementwiseKernels(lib)
    verified = {RMSNorm: self_test(lib, "rms_norm_bf16", lambda: rms_norm_mismatch(kernels)),
                SwiGLUMLP: self_test(lib, "silu_and_mul_bf16",
                                     lambda: silu_and_mul_mismatch(kernels)),
                LlamaAttention: self_test(lib, "rotary_bf16", lambda: rotary_mismatch(kernels))}
    targets = [m for m in targets if verified[next(c for c in verified if isinstance(m, c))]]
    for module in targets:
        module.cpu_kernels = kernels
    return len(targets)
