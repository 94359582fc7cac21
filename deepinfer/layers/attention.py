"""The attention seam between the model and the runtime.

The model computes q/k/v (RoPE and q/k-norm applied) for a flat batch of tokens and hands
them to an `AttentionBackend`, which owns everything sequence-shaped: which tokens belong to
which request, causality, the paged KV cache and the softmax scale. The model never sees
sequence boundaries, so one forward serves any mix of prefill chunks and decodes.
"""
from __future__ import annotations

from typing import Protocol

import torch.nn.functional as F
from torch import Tensor


class AttentionBackend(Protocol):
    def forward(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q [T, num_heads, head_dim], k/v [T, num_kv_heads, head_dim] (RoPE and q/k-norm already
        applied, same dtype as the model). Returns [T, num_heads, head_dim]. The backend owns
        scaling (1/sqrt(head_dim)), causality, the KV cache and which tokens belong to which sequence.
        q/k/v may be strided views into one projection output (do not assume contiguity)."""
        ...


class ContiguousCausalAttention:
    """One sequence, no cache: causal SDPA over exactly the tokens of this forward.

    For reference tests and one-shot scoring; positions must be 0..T-1 of a single sequence.
    """

    def forward(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        num_heads, num_kv_heads = q.shape[1], k.shape[1]
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}")
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1),  # [heads, T, d]
            k.transpose(0, 1),  # [kv_heads, T, d]
            v.transpose(0, 1),
            is_causal=True,
            enable_gqa=num_heads != num_kv_heads,
        )
        return out.transpose(0, 1)  # [T, heads, d]
