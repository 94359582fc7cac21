"""RMSNorm (Llama / Qwen)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight over the last dimension.

    One fused kernel for every dtype: PyTorch accumulates in float32 for bf16/fp16 inputs and
    rounds once at the end. (HF rounds to the input dtype before scaling by the weight, so
    bf16 results can differ from HF in the last bit; fp32 results are identical.)
    """

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.cpu_kernels = None  # set by runtime.cpu_elementwise_kernels on bf16 CPU models

    def forward(self, x: Tensor) -> Tensor:
        if self.cpu_kernels is not None and self.cpu_kernels.applies(x):
            return self.cpu_kernels.rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
