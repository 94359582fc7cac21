"""SwiGLU feed-forward with gate and up projections fused into one matmul."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deepinfer.layers.empty_init import uninitialized


class SwiGLUMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); `gate_up_proj.weight` is [2 * intermediate, hidden] with
    the gate rows first (loaders write HF gate_proj / up_proj into the two halves)."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype):
        super().__init__()
        self.intermediate_size = intermediate_size
        # weights come from the checkpoint, random init would only cost time.
        self.gate_up_proj = uninitialized(nn.Linear, hidden_size, 2 * intermediate_size, bias=False, dtype=dtype)
        self.down_proj = uninitialized(nn.Linear, intermediate_size, hidden_size, bias=False, dtype=dtype)

    cpu_kernels = None  # set by runtime.cpu_elementwise_kernels on bf16 CPU models

    def forward(self, x: Tensor) -> Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 * intermediate]
        if self.cpu_kernels is not None and self.cpu_kernels.applies(gate_up):
            return self.down_proj(self.cpu_kernels.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)
