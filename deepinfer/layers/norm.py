"""RMSNorm, computed in float32 like Hugging Face (then cast back to the input dtype)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight over the last dimension.

    Matches HF `LlamaRMSNorm`: normalise in float32, cast to the input dtype, then scale.
    """

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return normed.to(x.dtype) * self.weight
