"""Linear and embedding modules over a `QuantizedWeight`.

`QuantizedLinear.forward` asks its kernel (set by the runtime once the kernel passed its
load-time self-test; any object with `linear(x, weight, bias)` returning a tensor, or None
when it does not take that input) and otherwise runs the reference path: dequantize the weight
(in the activation dtype) and matmul. The reference path is the checked fallback: slow, but it
keeps no expanded copy of the weight between calls.
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deepinfer.quant.quantized_weight import QuantizedWeight


class QuantKernel(Protocol):
    def linear(self, x: Tensor, weight: QuantizedWeight, bias: Tensor | None) -> Tensor | None:
        """x [M, in] -> [M, out] in x.dtype, or None when the kernel does not take `x`."""
        ...

    def dots_f32(self, x: Tensor, weight: QuantizedWeight) -> Tensor | None:
        """x [M, in] -> x @ W.T [M, out] in float32 (no rounding), or None."""
        ...


class QuantizedLinear(nn.Module):
    """y = x @ W.T + bias with W kept quantized. x [..., in_features] -> [..., out_features]."""

    def __init__(self, weight: QuantizedWeight, bias: Tensor | None = None) -> None:
        super().__init__()
        self.qweight = weight
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.kernel: QuantKernel | None = None

    @property
    def format(self) -> str:
        return self.qweight.format

    def extra_repr(self) -> str:
        return (f"format={self.format}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.bias is not None}")

    def _apply(self, fn, recurse=True):
        """Module.to / .cuda / .cpu move the quantized tensors too (they are not parameters)."""
        moved = fn(torch.empty(0, device=self.qweight.device))
        if moved.device != self.qweight.device:
            self.qweight = self.qweight.to(moved.device)
        return super()._apply(fn, recurse)

    def reference(self, x: Tensor) -> Tensor:
        """Dequantize-then-matmul (the path every kernel is checked against)."""
        return F.linear(x, self.qweight.dequantize(x.dtype), self.bias)

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, self.in_features)
        out = None
        if self.kernel is not None:
            out = self.kernel.linear(flat, self.qweight, self.bias)
        if out is None:
            out = self.reference(flat)
        return out.view(*x.shape[:-1], self.out_features)

    def logits_f32(self, x: Tensor) -> Tensor | None:
        """x @ W.T in float32 for an LM head (no bias), or None (then use forward)."""
        if self.kernel is None or self.bias is not None:
            return None
        return self.kernel.dots_f32(x, self.qweight)


class QuantizedEmbedding(nn.Module):
    """Token embedding over a quantized [vocab, hidden] table; rows are dequantized on lookup.
    `weight_dtype` is the dtype lookups return (the model's activation dtype)."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.qweight = weight
        self.num_embeddings, self.embedding_dim = weight.out_features, weight.in_features
        self.dtype = dtype

    _apply = QuantizedLinear._apply

    def extra_repr(self) -> str:
        return f"format={self.qweight.format}, {self.num_embeddings}, {self.embedding_dim}"

    def forward(self, ids: Tensor) -> Tensor:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
            raise IndexError("token id out of range of the embedding table")
        rows = self.qweight.dequantize_rows(ids.reshape(-1), self.dtype)
        return rows.view(*ids.shape, self.embedding_dim)
