"""Linear and embedding modules over `QuantizedWeight`s.

`QuantizedLinear.forward` asks its kernel (set by the runtime once the kernel passed its
load-time self-test; any object with `linear(x, weight, bias)` returning a tensor, or None
when it does not take that input) and otherwise runs the reference path: dequantize the weight
(in the activation dtype) and matmul. The reference path is the checked fallback: slow, but it
keeps no expanded copy of the weight between calls.

A fused projection whose checkpoint parts come in different formats (a GGUF Q4_K_M file's
q/k in q4_k and v in q6_k) holds one `QuantizedWeight` per part, stacked by rows: the output
is the parts' outputs side by side. The quantized tensors are non-persistent buffers, so
`Module.to` moves them and `buffers()` counts them.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd import profiler as _profiler

from deepinfer.quant.quantized_weight import QuantizedWeight


class QuantKernel(Protocol):
    def linear(self, x: Tensor, weight: QuantizedWeight, bias: Tensor | None) -> Tensor | None:
        """x [M, in] -> [M, out] in x.dtype, or None when the kernel does not take `x`."""
        ...

    def dots_f32(self, x: Tensor, weight: QuantizedWeight) -> Tensor | None:
        """x [M, in] -> x @ W.T [M, out] in float32 (no rounding), or None."""
        ...

    def dequantize_rows(self, weight: QuantizedWeight, row_ids: Tensor, dtype: torch.dtype) -> Tensor:
        """Rows `row_ids` of W as `dtype` [n, in]."""
        ...


class _QuantizedTensors(nn.Module):
    """Holds `parts` as buffers and rebuilds them after Module.to / .cuda / .cpu."""

    def _hold(self, parts: Sequence[QuantizedWeight]) -> None:
        self.parts = tuple(parts)
        for i, part in enumerate(self.parts):
            self.register_buffer(f"qdata{i}", part.data, persistent=False)
            self.register_buffer(f"qscale{i}", part.scale, persistent=False)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.parts = tuple(QuantizedWeight(p.format, p.out_features, p.in_features,
                                           getattr(self, f"qdata{i}"), getattr(self, f"qscale{i}"),
                                           p.block) for i, p in enumerate(self.parts))
        return self

    @property
    def qweight(self) -> QuantizedWeight:
        """The weight of a single-part module."""
        if len(self.parts) != 1:
            raise AttributeError(f"{type(self).__name__} holds {len(self.parts)} parts")
        return self.parts[0]

    @property
    def formats(self) -> tuple[str, ...]:
        return tuple(p.format for p in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


class QuantizedLinear(_QuantizedTensors):
    """y = x @ W.T + bias with W kept quantized. x [..., in_features] -> [..., out_features]."""

    def __init__(self, weight: QuantizedWeight | Sequence[QuantizedWeight],
                 bias: Tensor | None = None) -> None:
        super().__init__()
        parts = (weight,) if isinstance(weight, QuantizedWeight) else tuple(weight)
        if not parts or len({p.in_features for p in parts}) != 1:
            raise ValueError("parts of a quantized linear must share in_features")
        self._hold(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.kernel: QuantKernel | None = None

    def extra_repr(self) -> str:
        return (f"formats={'+'.join(self.formats)}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.bias is not None}")

    def _biases(self) -> list[Tensor | None]:
        if self.bias is None:
            return [None] * len(self.parts)
        return list(self.bias.split([p.out_features for p in self.parts]))

    def reference(self, x: Tensor) -> Tensor:
        """Dequantize-then-matmul (the path every kernel is checked against); x [M, in]."""
        weight = torch.cat([p.dequantize(x.dtype) for p in self.parts])
        return F.linear(x, weight, self.bias)

    def forward(self, x: Tensor) -> Tensor:
        # The kernels are C calls the profiler cannot see: name them while it records.
        if _profiler._is_profiler_enabled:
            with torch.profiler.record_function(
                    f"deepinfer::quantized_linear[{'+'.join(self.formats)}]"):
                return self._forward(x)
        return self._forward(x)

    def _forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, self.in_features)
        out = None
        if self.kernel is not None:
            outs = [self.kernel.linear(flat, p, b) for p, b in zip(self.parts, self._biases())]
            if all(o is not None for o in outs):
                out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        if out is None:
            out = self.reference(flat)
        return out.view(*x.shape[:-1], self.out_features)

    def logits_f32(self, x: Tensor) -> Tensor:
        """x [M, in] @ W.T in float32 for an LM head (no bias): the kernel's float32 dots, or
        the reference in float32."""
        if self.kernel is not None and self.bias is None:
            outs = [self.kernel.dots_f32(x, p) for p in self.parts]
            if all(o is not None for o in outs):
                return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        return F.linear(x.float(), torch.cat([p.dequantize(torch.float32) for p in self.parts]),
                        None if self.bias is None else self.bias.float())


class QuantizedEmbedding(_QuantizedTensors):
    """Token embedding over a quantized [vocab, hidden] table; rows are dequantized on lookup
    into `dtype` (the model's activation dtype)."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self._hold((weight,))
        self.num_embeddings, self.embedding_dim = weight.out_features, weight.in_features
        self.dtype = dtype
        self.kernel: QuantKernel | None = None

    def extra_repr(self) -> str:
        return f"format={self.qweight.format}, {self.num_embeddings}, {self.embedding_dim}"

    def forward(self, ids: Tensor) -> Tensor:
        flat = ids.reshape(-1)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError("token id out of range of the embedding table")
        if self.kernel is not None and self.dtype in (torch.bfloat16, torch.float32):
            rows = self.kernel.dequantize_rows(self.qweight, flat, self.dtype)
        else:
            rows = self.qweight.dequantize_rows(flat, self.dtype)
        return rows.view(*ids.shape, self.embedding_dim)
