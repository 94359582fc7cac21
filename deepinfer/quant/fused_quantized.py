"""Fused projections and MoE experts over quantized weights.

A fused q/k/v or gate/up projection is one matrix whose parts are stacked by rows. Block-scaled
FP8 parts stack into one `QuantizedWeight` only when every part but the last ends on a block
boundary (each scale row covers `block[0]` weight rows): that holds for every released
checkpoint (dimensions are multiples of 128), and then the fused layer holds one matrix.
Otherwise (small test shapes with partial blocks) the `QuantizedLinear` keeps the parts as
separate matrices and puts their outputs side by side.

`QuantizedMoEExperts` is `MoEExperts` (moe/layer.py) with one quantized gate/up and one down
projection module per expert instead of stacked dense tensors; the forward groups the
(token, expert) pairs the same way. With a decode kernel set (`set_kernel`, by
runtime/cpu_moe_kernel.py) up to `kernel.max_tokens` tokens take one C call over the experts'
weight descriptors instead.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deepinfer.quant.quantized_linear import QuantizedLinear
from deepinfer.quant.quantized_weight import FP8_BLOCK, QuantizedWeight


def stackable(parts: list[QuantizedWeight]) -> bool:
    """Whether the parts concatenate by rows into one weight of the same format, exactly."""
    first = parts[0]
    if any(p.format != first.format or p.in_features != first.in_features
           or p.block != first.block for p in parts):
        return False
    if first.format == FP8_BLOCK:
        return all(p.out_features % first.block[0] == 0 for p in parts[:-1])
    return True


def stack_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """One weight holding `parts`' rows in order (see `stackable`)."""
    first = parts[0]
    data = torch.cat([p.data for p in parts], dim=0)
    scale = None if first.scale is None else torch.cat([p.scale for p in parts], dim=0)
    return QuantizedWeight(first.format, sum(p.out_features for p in parts), first.in_features,
                           data, scale, first.block)


def fused_quantized_linear(parts: list[QuantizedWeight], bias: Tensor | None = None) -> QuantizedLinear:
    """The fused projection of `parts` (row order): one matrix when they stack, else a
    QuantizedLinear of several parts (outputs side by side)."""
    if len(parts) > 1 and stackable(parts):
        parts = [stack_rows(parts)]
    return QuantizedLinear(parts, bias)


class QuantizedMoEExperts(nn.Module):
    """Routed experts with quantized weights: expert e computes
    down_e(silu(gate) * up) with [gate | up] = gate_up_e(x) ([n, 2I])."""

    def __init__(self, gate_up: list[nn.Module], down: list[nn.Module],
                 intermediate_size: int) -> None:
        super().__init__()
        if len(gate_up) != len(down) or not gate_up:
            raise ValueError("every expert needs a gate/up and a down projection")
        self.num_experts = len(gate_up)
        self.intermediate_size = intermediate_size
        self.gate_up = nn.ModuleList(gate_up)
        self.down = nn.ModuleList(down)
        self.kernel = None
        self.kernel_descs: Tensor | None = None  # [E, 3, 8] descriptors of the weights

    def set_kernel(self, kernel, descs: Tensor) -> None:
        """Use `kernel` with `descs`, these experts' weight descriptors (the kernel's format)."""
        self.kernel, self.kernel_descs = kernel, descs

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.kernel = self.kernel_descs = None  # the descriptors point at the old tensors
        return self

    def expert_mlp(self, expert: int, x: Tensor) -> Tensor:
        """x [n, hidden] through expert `expert` -> [n, hidden]."""
        gate, up = self.gate_up[expert](x).split(self.intermediate_size, dim=-1)
        return self.down[expert](F.silu(gate) * up)

    def forward(self, x: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
        """x [T, hidden], topk_weights [T, k] (float), topk_ids [T, k] -> [T, hidden]."""
        kernel = self.kernel
        if kernel is not None and x.shape[0] <= kernel.max_tokens:
            out = kernel.quantized(x, topk_weights, topk_ids, self.kernel_descs,
                                   self.intermediate_size)
            if out is not None:
                return out
        return self.torch_forward(x, topk_weights, topk_ids)

    def torch_forward(self, x: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
        """The grouped path over the projection modules; the kernel's reference."""
        k = topk_ids.shape[1]
        flat_ids = topk_ids.reshape(-1)  # [T*k]
        order = flat_ids.argsort(stable=True)  # pairs grouped by expert
        token_idx = order // k
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        sorted_x = x.index_select(0, token_idx)  # [T*k, hidden]
        out = torch.empty_like(sorted_x)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                out[start:start + count] = self.expert_mlp(expert, sorted_x[start:start + count])
                start += count
        weights = topk_weights.reshape(-1).index_select(0, order).unsqueeze(1)  # [T*k, 1]
        return torch.zeros_like(x).index_add_(0, token_idx, (out * weights).to(x.dtype))
