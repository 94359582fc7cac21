"""Paged attention for CUDA devices, behind the same seam as runtime/paged_attention.py.

`CudaPagedAttention(cache, metadata, num_heads).forward(layer_idx, q, k, v)` has the interface of
`PagedAttention` and takes the runner's `AttentionMetadata` (it reads only the slot mapping,
the decode block tables and context lengths, and each prefill chunk's start, length, prefix
length and prefix blocks). Two kernels:

* FlashInfer (`pip install -e .[gpu]`), when importable: one `BatchPrefillWithPagedKVCacheWrapper`
  planned once per step runs the whole mixed batch (decodes are 1-token queries) reading K/V
  through the block tables: no gather, no mask tensor. Its `plan()` needs the per-request
  lengths on the host; they are read back once per step (the GPU is idle at step start).
* torch SDPA otherwise, with no boolean masks (which push CUDA SDPA off its fused kernels):
  decodes gather their blocks and use one additive float bias per step built on the device from
  the context lengths; prefill chunks use `is_causal` (no prefix) or torch's lower-right
  `CausalBias` (prefix), both of which the flash / memory-efficient kernels take. Shapes depend
  only on the block-table width, so this path is also what the CUDA-graph decode runner
  (runtime/cuda_graphs.py) captures.

The SDPA path is device-agnostic, so it is tested against `PagedAttention` on CPU too.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right

from deepinfer.runtime.kv_cache import PagedKVCache


def flashinfer_available() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


@dataclass
class CudaDecodeBatch:
    """The decode rows of a step: flat tokens [0, num_tokens) of the batch."""
    num_tokens: int
    block_table: Tensor  # [B, W] long; entries past a request's blocks are any valid block id
    context_lens: Tensor  # [B] long, tokens each decode attends to (its new token included)


@dataclass
class CudaPrefillChunk:
    start: int
    num_tokens: int
    num_computed_tokens: int
    block_ids: Tensor | None  # [num_blocks] long covering prefix + chunk; None when no prefix


@dataclass
class CudaStepMetadata:
    slot_mapping: Tensor  # [T] long
    decode: CudaDecodeBatch | None
    prefills: list[CudaPrefillChunk]

    @classmethod
    def from_attention_metadata(cls, meta) -> CudaStepMetadata:
        """From runtime.paged_attention.AttentionMetadata (attribute reads only)."""
        decode = None
        if meta.decode is not None:
            num = meta.decode.num_tokens
            decode = CudaDecodeBatch(num, meta.decode.block_ids.view(num, -1),
                                     meta.decode.context_lens)
        chunks = [CudaPrefillChunk(c.start, c.num_tokens, c.num_computed_tokens, c.block_ids)
                  for c in meta.prefills]
        return cls(meta.slot_mapping, decode, chunks)


class CudaPagedAttention:
    """AttentionBackend for one step (CUDA; the SDPA path also runs on CPU)."""

    def __init__(self, cache: PagedKVCache, metadata, num_heads: int,
                 flashinfer_workspace: Tensor | None = None) -> None:
        self.cache = cache
        self.meta = (metadata if isinstance(metadata, CudaStepMetadata)
                     else CudaStepMetadata.from_attention_metadata(metadata))
        self.num_heads = num_heads
        self._decode_bias: Tensor | None = None  # built by the first layer, shared by all
        self._flashinfer = None
        if flashinfer_workspace is not None:
            self._flashinfer = _plan_flashinfer(cache, self.meta, num_heads, flashinfer_workspace)

    def forward(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        k_cache, v_cache = self.cache.layer(layer_idx)  # [blocks, bs, KV, d]
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        slots = self.meta.slot_mapping
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v)
        if self._flashinfer is not None:
            return self._flashinfer.run(q.contiguous(), (k_cache, v_cache))  # [T, H, d]
        out = torch.empty_like(q)
        if self.meta.decode is not None:
            self._decode(q, k_cache, v_cache, out)
        for chunk in self.meta.prefills:
            self._prefill(chunk, q, k, v, k_cache, v_cache, out)
        return out

    def decode_bias(self, ctx: int, dtype: torch.dtype) -> Tensor:
        """[B, 1, 1, ctx] additive bias: 0 for context positions, -inf for padding."""
        if self._decode_bias is None:
            d = self.meta.decode
            pos = torch.arange(ctx, device=d.context_lens.device)
            bias = torch.zeros(d.num_tokens, ctx, dtype=dtype, device=d.context_lens.device)
            bias.masked_fill_(pos.unsqueeze(0) >= d.context_lens.unsqueeze(1), float("-inf"))
            self._decode_bias = bias[:, None, None, :]
        return self._decode_bias

    def _decode(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, out: Tensor) -> None:
        d = self.meta.decode
        num, width = d.block_table.shape
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        ctx = width * k_cache.shape[1]
        # [B, W, bs, KV, d] -> [B, KV, ctx, d] (strided view of the gathered copy)
        keys = k_cache[d.block_table].view(num, ctx, num_kv_heads, head_dim).transpose(1, 2)
        values = v_cache[d.block_table].view(num, ctx, num_kv_heads, head_dim).transpose(1, 2)
        # Query heads sharing a KV head are that head's query rows: [B, KV, H/KV, d].
        query = q[:num].view(num, num_kv_heads, -1, head_dim)
        o = F.scaled_dot_product_attention(query, keys, values,
                                           attn_mask=self.decode_bias(ctx, q.dtype))
        out[:num] = o.reshape(num, -1, head_dim)

    def _prefill(self, chunk: CudaPrefillChunk, q: Tensor, k: Tensor, v: Tensor,
                 k_cache: Tensor, v_cache: Tensor, out: Tensor) -> None:
        lo, hi = chunk.start, chunk.start + chunk.num_tokens
        gqa = self.num_heads != k_cache.shape[2]
        query = q[lo:hi].transpose(0, 1).unsqueeze(0)  # [1, H, x, d]
        if chunk.block_ids is None:
            keys = k[lo:hi].transpose(0, 1).unsqueeze(0)  # [1, KV, x, d]
            values = v[lo:hi].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(query, keys, values, is_causal=True,
                                               enable_gqa=gqa)
        else:
            ctx = chunk.num_computed_tokens + chunk.num_tokens
            num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
            keys = k_cache[chunk.block_ids].view(-1, num_kv_heads, head_dim)[:ctx]
            values = v_cache[chunk.block_ids].view(-1, num_kv_heads, head_dim)[:ctx]
            keys = keys.transpose(0, 1).unsqueeze(0)  # [1, KV, ctx, d]
            values = values.transpose(0, 1).unsqueeze(0)
            # Query i sits at position P + i: bottom-right aligned causal mask, no tensor.
            o = F.scaled_dot_product_attention(
                query, keys, values, attn_mask=causal_lower_right(chunk.num_tokens, ctx),
                enable_gqa=gqa)
        out[lo:hi] = o[0].transpose(0, 1)


class CudaAttentionBuilder:
    """Held by the runner on CUDA: one FlashInfer workspace for all steps (when available),
    one `CudaPagedAttention` per step."""

    WORKSPACE_BYTES = 128 * 1024 * 1024

    def __init__(self, cache: PagedKVCache, num_heads: int, use_flashinfer: bool | None = None):
        self.cache = cache
        self.num_heads = num_heads
        if use_flashinfer is None:  # FlashInfer's kernels take 16-bit K/V only
            use_flashinfer = (cache.kv.device.type == "cuda" and flashinfer_available()
                              and cache.spec.dtype in (torch.bfloat16, torch.float16))
        self.workspace = None
        if use_flashinfer:
            self.workspace = torch.empty(self.WORKSPACE_BYTES, dtype=torch.uint8,
                                         device=cache.kv.device)

    def build(self, metadata) -> CudaPagedAttention:
        return CudaPagedAttention(self.cache, metadata, self.num_heads, self.workspace)


def _plan_flashinfer(cache: PagedKVCache, meta: CudaStepMetadata, num_heads: int,
                     workspace: Tensor):
    """One FlashInfer prefill wrapper planned for the step's mixed batch (NHD page layout is
    the cache's own [block, slot, kv_head, head_dim]); causal is bottom-right aligned."""
    import flashinfer

    spec = cache.spec
    bs = spec.block_size
    qo_lens, kv_lens, tables = [], [], []
    if meta.decode is not None:
        lens = meta.decode.context_lens.tolist()  # the step's one read-back (see module doc)
        for row, n in enumerate(lens):
            qo_lens.append(1)
            kv_lens.append(n)
            tables.append(meta.decode.block_table[row, :-(-n // bs)])
    for c in meta.prefills:
        n = c.num_computed_tokens + c.num_tokens
        qo_lens.append(c.num_tokens)
        kv_lens.append(n)
        if c.block_ids is not None:
            tables.append(c.block_ids[:-(-n // bs)])
        else:  # the chunk's own blocks: the slot of every block_size-th token
            first = meta.slot_mapping[c.start:c.start + c.num_tokens:bs]
            tables.append(torch.div(first, bs, rounding_mode="floor"))
    qo_indptr = torch.tensor([0] + _cumsum(qo_lens), dtype=torch.int32)
    num_pages = [-(-n // bs) for n in kv_lens]
    kv_indptr = torch.tensor([0] + _cumsum(num_pages), dtype=torch.int32)
    last_page_len = torch.tensor([n - (p - 1) * bs for n, p in zip(kv_lens, num_pages)],
                                 dtype=torch.int32)
    indices = torch.cat(tables).to(torch.int32)  # on the device
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
    # Host indptrs: plan() needs them on the host and copies them to the device itself.
    wrapper.plan(qo_indptr, kv_indptr, indices, last_page_len,
                 num_heads, spec.num_kv_heads, spec.head_dim, bs, causal=True,
                 q_data_type=spec.dtype, kv_data_type=spec.dtype)
    return wrapper


def _cumsum(values: list[int]) -> list[int]:
    out, total = [], 0
    for v in values:
        total += v
        out.append(total)
    return out
