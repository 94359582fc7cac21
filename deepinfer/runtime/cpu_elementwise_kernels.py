"""Fused bf16 RMSNorm and SiLU-and-mul for CPU (kernels/fused_elementwise.c).

`install_elementwise_kernels(model)` hands the loaded kernels to each bf16 RMSNorm and
SwiGLU MLP of a CPU model (an explicit per-module attribute, no global switch); the modules
fall back to their torch code for any other dtype, device or a non-contiguous input.
"""
from __future__ import annotations

import ctypes

import torch
from torch import Tensor, nn

from deepinfer.runtime.cpu_kernel_build import load_kernel_library

_P, _I64, _INT, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


class ElementwiseKernels:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self._rms_norm = lib.rms_norm_bf16
        self._rms_norm.argtypes = [_P, _P, _P, _I64, _INT, _F, _INT]
        self._silu_and_mul = lib.silu_and_mul_bf16
        self._silu_and_mul.argtypes = [_P, _P, _I64, _INT, _INT]

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


def install_elementwise_kernels(model: nn.Module) -> int:
    """Give the bf16 CPU norms and MLPs of `model` the fused kernels; returns how many."""
    from deepinfer.layers.mlp import SwiGLUMLP
    from deepinfer.layers.norm import RMSNorm

    targets = [m for m in model.modules() if isinstance(m, (RMSNorm, SwiGLUMLP))
               and next(m.parameters(), torch.empty(0)).dtype == torch.bfloat16]
    if not targets:
        return 0
    lib = load_kernel_library("fused_elementwise")
    if lib is None:
        return 0
    kernels = ElementwiseKernels(lib)
    for module in targets:
        module.cpu_kernels = kernels
    return len(targets)
