"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode-only step of B requests runs in the smallest captured bucket Bp >= B. Every input
lives in a static buffer sized for the largest bucket; a step copies its tensors in (device to
device, no host sync) and replays the graph; the caller reads the first B rows of the hidden
states. Rows B..Bp-1 repeat row 0 (same token, position, slot and block table), so they write
row 0's own K/V values to row 0's slot and their outputs are dropped; no slot of another
request is touched.

    static buffers (largest bucket P, W = max blocks per request)
      input_ids [P]  positions [P]  slot_mapping [P]  context_lens [P]  block_table [P, W]
    bucket Bp uses rows [0, Bp) of each

Attention inside the graph is CudaPagedAttention's SDPA path over the full width W (its
shapes depend only on Bp and W; padding blocks are masked by the per-step float bias).

Contract for `capture()`: call it before any request owns KV block 0 (at start-up): the
warm-up forward writes to slot 0. `capture_graphs=False` runs the same static-buffer path
eagerly (CPU tests, debugging); the outputs must equal the graphs'.
"""
from __future__ import annotations

import torch
from torch import Tensor

from deepinfer.runtime.cuda_attention import (CudaDecodeBatch, CudaPagedAttention,
                                              CudaStepMetadata)
from deepinfer.runtime.kv_cache import PagedKVCache

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class CudaGraphDecodeRunner:
    def __init__(self, model: torch.nn.Module, cache: PagedKVCache, num_heads: int,
                 max_blocks_per_seq: int, batch_sizes: tuple[int, ...] = DEFAULT_BUCKETS,
                 capture_graphs: bool | None = None) -> None:
        if not batch_sizes or min(batch_sizes) < 1:
            raise ValueError("batch_sizes must be positive")
        self.model = model
        self.cache = cache
        self.num_heads = num_heads
        self.buckets = tuple(sorted(set(batch_sizes)))
        device = cache.kv.device
        self.capture_graphs = device.type == "cuda" if capture_graphs is None else capture_graphs
        if self.capture_graphs and device.type != "cuda":
            raise ValueError("CUDA graphs need the KV cache on a CUDA device")
        size = self.buckets[-1]
        long = dict(dtype=torch.long, device=device)
        self.input_ids = torch.zeros(size, **long)
        self.positions = torch.zeros(size, **long)
        self.slot_mapping = torch.zeros(size, **long)
        self.context_lens = torch.ones(size, **long)  # >= 1: no all-masked row in warm-up
        self.block_table = torch.zeros(size, max_blocks_per_seq, **long)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, Tensor] = {}  # bucket -> the graph's hidden states [Bp, hidden]

    @property
    def max_blocks_per_seq(self) -> int:
        return self.block_table.shape[1]

    def bucket(self, num_decodes: int) -> int | None:
        """The smallest bucket holding `num_decodes` rows; None when none does."""
        return next((b for b in self.buckets if b >= num_decodes), None)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per bucket, largest first, sharing one memory pool."""
        if not self.capture_graphs:
            return
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up off the capture (lazy library init)
            self._forward(self.buckets[-1])
        torch.cuda.current_stream().wait_stream(stream)
        for size in reversed(self.buckets):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize()

    @torch.inference_mode()
    def run(self, input_ids: Tensor, positions: Tensor, slot_mapping: Tensor,
            block_table: Tensor, context_lens: Tensor) -> Tensor:
        """Hidden states [B, hidden] of a decode-only step (B rows, block_table [B, w <= W])."""
        num, width = block_table.shape
        size = self.bucket(num)
        if size is None or width > self.max_blocks_per_seq:
            raise ValueError(f"decode batch {num} x {width} blocks exceeds the captured "
                             f"{self.buckets[-1]} x {self.max_blocks_per_seq}")
        pad = size - num
        for static, src in ((self.input_ids, input_ids), (self.positions, positions),
                            (self.slot_mapping, slot_mapping), (self.context_lens, context_lens)):
            static[:num].copy_(src)
            if pad:
                static[num:size].copy_(src[:1].expand(pad))
        # Columns past `width` keep older (valid) block ids: the bias masks them.
        self.block_table[:num, :width].copy_(block_table)
        if pad:
            self.block_table[num:size, :width].copy_(block_table[:1].expand(pad, width))
        if self.capture_graphs:
            self.graphs[size].replay()
            return self.outputs[size][:num]
        return self._forward(size)[:num]

    def can_run(self, meta) -> bool:
        """Whether a step with the runner's AttentionMetadata fits: decodes only, within the
        largest bucket and the captured block-table width."""
        d = meta.decode
        if meta.prefills or d is None or self.bucket(d.num_tokens) is None:
            return False
        return d.block_ids.numel() // d.num_tokens <= self.max_blocks_per_seq

    def run_step(self, input_ids: Tensor, positions: Tensor, meta) -> Tensor:
        """`run` from the runner's own step tensors (the hook for ModelRunner.execute)."""
        step = CudaStepMetadata.from_attention_metadata(meta)
        return self.run(input_ids, positions, step.slot_mapping, step.decode.block_table,
                        step.decode.context_lens)

    def _forward(self, size: int) -> Tensor:
        meta = CudaStepMetadata(self.slot_mapping[:size],
                                CudaDecodeBatch(size, self.block_table[:size],
                                                self.context_lens[:size]), [])
        attn = CudaPagedAttention(self.cache, meta, self.num_heads)
        return self.model(self.input_ids[:size], self.positions[:size], attn)
