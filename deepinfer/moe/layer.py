"""The MoE feed-forward: router -> `select_experts` -> `MoEExperts` (+ shared experts).

`MoEExperts` is the seam the expert-parallel issue swaps: it takes tokens with their chosen
expert ids and weights and returns the weighted sum of the experts' outputs. Weights are
stacked, HF-v5 style, so a fused checkpoint loads as is:

    gate_up_proj [E, 2 * I, hidden]   rows [gate (I) | up (I)] per expert
    down_proj    [E, hidden, I]

Compute groups the (token, expert) pairs by expert with one stable sort and runs one
gate_up and one down matmul per *active* expert over its contiguous slice; results are
scattered back with one index_add. No loop over tokens.

At decode (a few tokens) those per-expert ops cost more in overhead than in weight reads:
`kernel` (set by runtime/cpu_moe_kernel.install_moe_kernels once it passed its self-test
against `torch_forward`) computes every routed expert in one C call for up to
`kernel.max_tokens` tokens, and returns None for inputs it does not take.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deepinfer.layers.empty_init import uninitialized
from deepinfer.layers.mlp import SwiGLUMLP
from deepinfer.moe.moe_config import MoEConfig
from deepinfer.moe.routing import select_experts


class MoEExperts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype):
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        empty = torch.get_default_device()
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype, device=empty),
            requires_grad=False)
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size, dtype=dtype, device=empty),
            requires_grad=False)
        self.kernel = None  # the fused decode kernel (runtime/cpu_moe_kernel.py), or None

    def forward(self, x: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
        """x [T, hidden], topk_weights [T, k] (float), topk_ids [T, k] -> [T, hidden]."""
        kernel = self.kernel
        if kernel is not None and x.shape[0] <= kernel.max_tokens:
            out = kernel.bf16(x, topk_weights, topk_ids, self.gate_up_proj, self.down_proj)
            if out is not None:
                return out
        return self.torch_forward(x, topk_weights, topk_ids)

    def torch_forward(self, x: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
        """The grouped PyTorch path (any T, dtype and device); the kernel's reference."""
        num_tokens, k = topk_ids.shape
        flat_ids = topk_ids.reshape(-1)  # [T*k]
        order = flat_ids.argsort(stable=True)  # pairs grouped by expert
        token_idx = order // k  # [T*k] token of each sorted pair
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()  # one host sync
        sorted_x = x.index_select(0, token_idx)  # [T*k, hidden]
        out = torch.empty_like(sorted_x)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            end = start + count
            gate_up = F.linear(sorted_x[start:end], self.gate_up_proj[expert])  # [n, 2I]
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            out[start:end] = F.linear(F.silu(gate) * up, self.down_proj[expert])  # [n, hidden]
            start = end
        weights = topk_weights.reshape(-1).index_select(0, order).unsqueeze(1)  # [T*k, 1]
        out = (out * weights).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token_idx, out)


def naive_expert_loop(experts: MoEExperts, x: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
    """Reference/benchmark baseline: every expert over a boolean mask of all tokens."""
    out = torch.zeros_like(x)
    for expert in range(experts.num_experts):
        token_idx, slot = (topk_ids == expert).nonzero(as_tuple=True)
        if token_idx.numel() == 0:
            continue
        gate, up = F.linear(x[token_idx], experts.gate_up_proj[expert]).split(experts.intermediate_size, dim=-1)
        y = F.linear(F.silu(gate) * up, experts.down_proj[expert])
        out.index_add_(0, token_idx, (y * topk_weights[token_idx, slot, None]).to(x.dtype))
    return out


class SparseMoEBlock(nn.Module):
    """Router + routed experts (+ DeepSeek's shared experts, always on for every token).

    Parameter names follow HF: `gate.weight` [E, hidden], `gate.e_score_correction_bias` [E],
    `experts.*`, `shared_experts.gate_up_proj` / `down_proj`."""

    def __init__(self, config: MoEConfig, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        self.config = config
        router_dtype = torch.float32 if config.router_fp32 else dtype
        self.gate = uninitialized(nn.Linear, hidden_size, config.num_experts, bias=False, dtype=router_dtype)
        if config.use_correction_bias:
            self.gate.e_score_correction_bias = nn.Parameter(
                torch.zeros(config.num_experts, dtype=torch.float32), requires_grad=False)
        self.experts = MoEExperts(config.num_experts, hidden_size, config.moe_intermediate_size, dtype)
        self.shared_experts = (SwiGLUMLP(hidden_size, config.shared_intermediate_size, dtype)
                               if config.num_shared_experts else None)

    def forward(self, x: Tensor) -> Tensor:
        """x [T, hidden] -> [T, hidden]."""
        if self.config.router_fp32:
            logits = F.linear(x.float(), self.gate.weight)  # [T, E] fp32
        else:
            logits = self.gate(x)  # [T, E] model dtype, like the references
        bias = getattr(self.gate, "e_score_correction_bias", None)
        topk_weights, topk_ids = select_experts(logits, self.config, bias)
        out = self.experts(x, topk_weights, topk_ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
