"""Multi-head latent attention (DeepSeek-V2/V3) math over a latent context.

Per token the model produces a normalised latent `c` [r] (r = kv_lora_rank) and one roped key
`k_pe` [rope] shared by all heads; that pair is all an MLA cache stores. Per-head keys and
values come from kv_b_proj = [W_UK | W_UV] per head:

    expanded:  k_h = [W_UK_h c | k_pe],  v_h = W_UV_h c,   o_h = softmax(q_h·k_h s) v_h
    absorbed:  q'_h = [W_UK_hᵀ q_nope_h | q_pe_h]  scores = q'_h · [c | k_pe]
               o_h = W_UV_h (softmax(scores s) c)

Both give the same result; the absorbed form reads only the latent entries (one "head" of
r + rope values per token), which is what makes MLA decode cheap. The backend seam is
`MLAAttentionBackend.forward_mla`.

The up-projections may be held in float32 while activations are bf16 (`MLAWeights` from
DeepseekV3Attention.latent_weights on CPUs without native bf16 matmul): then the three
products with them run in float32 and their results are rounded to bf16 once, as a bf16
matmul rounds its float32 accumulation. Without AVX-512 BF16, torch's bf16 batched matmul
took 20-40x the time of the same float32 one at decode shapes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class MLAWeights:
    """One layer's up-projections out of the latent, views of kv_b_proj.weight."""

    w_uk: Tensor  # [H, nope, r]
    w_uv: Tensor  # [H, v, r]
    softmax_scale: float


def _up(spec: str, x: Tensor, w: Tensor) -> Tensor:
    """einsum(spec, x, w) in w's dtype, the result in x's."""
    return torch.einsum(spec, x.to(w.dtype), w).to(x.dtype)


class MLAAttentionBackend(Protocol):
    def forward_mla(self, layer_idx: int, q_nope: Tensor, q_pe: Tensor, latent: Tensor,
                    k_pe: Tensor, weights: MLAWeights) -> Tensor:
        """q_nope [T, H, nope], q_pe [T, H, rope] (roped), latent [T, r] (normalised), k_pe
        [T, rope] (roped) for a flat batch -> [T, H, v]. The backend owns causality, the
        latent cache and which tokens belong to which sequence."""
        ...


def mla_expanded(q_nope: Tensor, q_pe: Tensor, latent: Tensor, k_pe: Tensor, weights: MLAWeights,
                 attn_mask: Tensor | None = None, is_causal: bool = False) -> Tensor:
    """Attention of T queries over a context of C latent entries (latent [C, r], k_pe [C, rope]),
    per-head K/V materialised. attn_mask [T, C] bool (True = attend) -> [T, H, v]."""
    num_heads = q_nope.shape[1]
    k_nope = _up("cr,hnr->hcn", latent, weights.w_uk)  # [H, C, nope]
    values = _up("cr,hvr->hcv", latent, weights.w_uv)  # [H, C, v]
    keys = torch.cat((k_nope, k_pe.unsqueeze(0).expand(num_heads, -1, -1)), dim=-1)  # [H, C, nope+rope]
    query = torch.cat((q_nope, q_pe), dim=-1).transpose(0, 1)  # [H, T, nope+rope]
    out = F.scaled_dot_product_attention(query.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
                                         attn_mask=attn_mask, is_causal=is_causal,
                                         scale=weights.softmax_scale)  # [1, H, T, v]
    return out[0].transpose(0, 1)  # [T, H, v]


def absorb_query(q_nope: Tensor, q_pe: Tensor, weights: MLAWeights) -> Tensor:
    """[T, H, nope], [T, H, rope] -> latent-space queries [T, H, r + rope]."""
    q_latent = _up("thn,hnr->thr", q_nope, weights.w_uk)  # [T, H, r]
    return torch.cat((q_latent, q_pe), dim=-1)


def mla_absorbed(query: Tensor, entries: Tensor, weights: MLAWeights, attn_mask: Tensor | None) -> Tensor:
    """Batched absorbed attention: query [B, H, Tq, r + rope] (from `absorb_query`), entries
    [B, C, r + rope] (the latent cache rows), attn_mask broadcastable to [B, H, Tq, C] ->
    [B, Tq, H, v]."""
    rank = weights.w_uk.shape[-1]
    keys = entries.unsqueeze(1)  # [B, 1, C, r + rope]: one shared "head"
    values = entries[..., :rank].unsqueeze(1)  # [B, 1, C, r]
    num_heads = query.shape[1]
    o_latent = F.scaled_dot_product_attention(
        query, keys.expand(-1, num_heads, -1, -1), values.expand(-1, num_heads, -1, -1),
        attn_mask=attn_mask, scale=weights.softmax_scale)  # [B, H, Tq, r]
    return up_values(o_latent, weights)


def up_values(o_latent: Tensor, weights: MLAWeights) -> Tensor:
    """Attention output in latent space [B, H, Tq, r] (or [B, H, r]) -> [B, Tq, H, v] ([B, H, v])."""
    if o_latent.dim() == 3:
        return _up("bhr,hvr->bhv", o_latent, weights.w_uv)
    return _up("bhtr,hvr->bthv", o_latent, weights.w_uv)


class ContiguousMLAAttention:
    """One sequence, no cache (reference tests): causal MLA over this forward's tokens.
    `absorbed=True` runs the latent-space form instead of the expanded one."""

    def __init__(self, absorbed: bool = False) -> None:
        self.absorbed = absorbed

    def forward_mla(self, layer_idx: int, q_nope: Tensor, q_pe: Tensor, latent: Tensor,
                    k_pe: Tensor, weights: MLAWeights) -> Tensor:
        if not self.absorbed:
            return mla_expanded(q_nope, q_pe, latent, k_pe, weights, is_causal=True)
        num_tokens = q_nope.shape[0]
        query = absorb_query(q_nope, q_pe, weights).transpose(0, 1).unsqueeze(0)  # [1, H, T, r+rope]
        entries = torch.cat((latent, k_pe), dim=-1).unsqueeze(0)  # [1, T, r+rope]
        causal = torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=q_nope.device).tril()
        return mla_absorbed(query, entries, weights, causal)[0]  # [T, H, v]
