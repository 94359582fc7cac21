"""Paged MLA attention over the latent cache, for a mixed batch laid out like PagedAttention's:

    [ decode tok 0 | ... | decode tok B-1 | chunk 0 tokens ... | chunk 1 tokens ... ]

Every layer first writes each new token's entry [latent | k_pe] into its slot, then attends.
Decodes use the absorbed form (W_UK folded into the query, W_UV applied after attention), so
they read only the latent entries of their blocks. Prefill chunks expand per-head K/V from the
latent (cheaper for many queries): from this step's own entries when the chunk has no cached
prefix, else from the gathered prefix + chunk entries with an offset-causal mask.

On CPU the decodes' absorbed attention runs in the C kernel (cpu_mla_kernel.py) when the
runner passes one: it reads the entries through the block table, with no gather copy and no
mask; the torch gather + SDPA path is the reference and the fallback.
"""
from __future__ import annotations

import torch
from torch import Tensor

from deepinfer.layers.mla import MLAWeights, absorb_query, mla_absorbed, mla_expanded, up_values
from deepinfer.runtime.cpu_mla_kernel import MLADecodeKernel
from deepinfer.runtime.latent_kv_cache import PagedLatentKVCache
from deepinfer.runtime.paged_attention import AttentionMetadata, PrefillChunkMetadata


class PagedMLAAttention:
    """MLAAttentionBackend for one step (same metadata as `PagedAttention`)."""

    def __init__(self, cache: PagedLatentKVCache, metadata: AttentionMetadata,
                 decode_kernel: MLADecodeKernel | None = None) -> None:
        self.cache = cache
        self.meta = metadata
        self.decode_kernel = decode_kernel

    def forward_mla(self, layer_idx: int, q_nope: Tensor, q_pe: Tensor, latent: Tensor,
                    k_pe: Tensor, weights: MLAWeights) -> Tensor:
        entries = self.cache.layer(layer_idx)  # [blocks, bs, r + rope]
        entry_dim = entries.shape[-1]
        new = torch.cat((latent, k_pe), dim=-1)  # [T, r + rope]
        entries.view(-1, entry_dim).index_copy_(0, self.meta.slot_mapping, new)
        out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], weights.w_uv.shape[1])  # [T, H, v]
        if self.meta.decode is not None:
            self._decode(q_nope, q_pe, entries, weights, out)
        for chunk in self.meta.prefills:
            self._prefill(chunk, q_nope, q_pe, latent, k_pe, entries, weights, out)
        return out

    def _decode(self, q_nope: Tensor, q_pe: Tensor, entries: Tensor, weights: MLAWeights, out: Tensor) -> None:
        meta = self.meta.decode
        num = meta.num_tokens
        if self.decode_kernel is not None and self.decode_kernel.supports(entries.dtype, entries.device):
            query = absorb_query(q_nope[:num], q_pe[:num], weights)  # [B, H, r + rope]
            rank = weights.w_uk.shape[-1]
            o_latent = self.decode_kernel(query, entries, meta.block_ids.view(num, -1),
                                          meta.context_lens, rank, weights.softmax_scale)  # [B, H, r]
            out[:num] = up_values(o_latent, weights)
            return
        mask = meta.attn_mask
        if mask is None:  # the runner builds no mask when it expects the kernel
            ctx = torch.arange(meta.block_ids.numel() // num * entries.shape[1], device=entries.device)
            mask = (ctx.unsqueeze(0) < meta.context_lens.unsqueeze(1))[:, None, None, :]
        gathered = entries.index_select(0, meta.block_ids).view(num, -1, entries.shape[-1])  # [B, ctx, D]
        query = absorb_query(q_nope[:num], q_pe[:num], weights).unsqueeze(2)  # [B, H, 1, r + rope]
        out[:num] = mla_absorbed(query, gathered, weights, mask)[:, 0]  # [B, H, v]

    def _prefill(self, chunk: PrefillChunkMetadata, q_nope: Tensor, q_pe: Tensor, latent: Tensor,
                 k_pe: Tensor, entries: Tensor, weights: MLAWeights, out: Tensor) -> None:
        lo, hi = chunk.start, chunk.start + chunk.num_tokens
        if chunk.block_ids is None:
            out[lo:hi] = mla_expanded(q_nope[lo:hi], q_pe[lo:hi], latent[lo:hi], k_pe[lo:hi], weights,
                                      is_causal=True)
            return
        ctx = chunk.num_computed_tokens + chunk.num_tokens
        gathered = entries.index_select(0, chunk.block_ids).view(-1, entries.shape[-1])[:ctx]  # [ctx, D]
        rank = weights.w_uk.shape[-1]
        out[lo:hi] = mla_expanded(q_nope[lo:hi], q_pe[lo:hi], gathered[:, :rank], gathered[:, rank:],
                                  weights, attn_mask=chunk.attn_mask)
