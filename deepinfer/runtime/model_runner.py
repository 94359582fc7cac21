"""Runs one SchedulerOutput through the model: batch tensors, paged attention, sampling."""
from __future__ import annotations

import os
import time

import torch

from deepinfer.core.scheduler_output import ScheduledRequest, SchedulerOutput, StepResult
from deepinfer.runtime.cpu_decode_kernel import load_decode_kernel
from deepinfer.runtime.cpu_prefill_kernel import load_prefill_kernel
from deepinfer.runtime.input_batch import PersistentInputBatch
from deepinfer.runtime.kv_cache import PagedKVCache
from deepinfer.runtime.prompt_logprobs import compute_prompt_logprobs, wants_prompt_logprobs
from deepinfer.runtime.paged_attention import (AttentionMetadata, DecodeMetadata, PagedAttention,
                                               PrefillChunkMetadata)
from deepinfer.runtime.sampler import Sampler

# With the C decode kernel, chunks of up to this many tokens (speculative-decoding verification,
# short prefill tails) attend as decode rows: one query row per token, causal by its own context
# length, read through the block table. No per-layer gather of the prefix and no mask per request.
SHORT_CHUNK_TOKENS = 16


class ModelRunner:
    def __init__(self, model: torch.nn.Module, cache: PagedKVCache, device: torch.device,
                 seed: int = 0) -> None:
        self.model = model
        self.cache = cache
        self.device = device
        self.block_size = cache.spec.block_size
        self.num_heads = model.config.num_attention_heads
        self.sampler = Sampler(device, seed)
        kernel = load_decode_kernel() if device.type == "cpu" else None
        self.decode_kernel = kernel if kernel and kernel.supports(cache.spec.dtype, device) else None
        # MLA (latent cache): the C absorbed-form decode kernel instead, when it takes the dtype.
        self.mla_kernel = None
        if getattr(cache.spec, "is_latent", False):
            self.decode_kernel = None  # the C kernel reads per-head K/V blocks
            from deepinfer.runtime.cpu_mla_kernel import load_mla_kernel
            mla = load_mla_kernel() if device.type == "cpu" else None
            self.mla_kernel = mla if mla and mla.supports(cache.spec.dtype, device) else None
        # The C prefill attention kernel for bf16 caches (PagedAttention keeps SDPA for head
        # shapes it does not take); None on other devices and dtypes.
        self.prefill_kernel = (load_prefill_kernel() if device.type == "cpu"
                               and cache.spec.dtype == torch.bfloat16 else None)
        # Block-table rows kept across steps (runtime/input_batch.py); `_prepare` is the plain
        # build every step (the reference; DEEPINFER_PERSISTENT_BATCH=0 uses it in execute).
        self.input_batch = (PersistentInputBatch(self.block_size, device)
                            if os.environ.get("DEEPINFER_PERSISTENT_BATCH", "1") != "0" else None)
        self.persistent_min_requests = 8
        # Expert parallelism: a step that schedules nothing must still join the group's
        # MoE collectives (deepinfer.moe.expert_parallel.ExpertParallelRuntime.run_empty_step).
        self.empty_step_hook = None
        # Speculative decoding: a deepinfer.spec.verifier.SpecVerifier samples the step.
        self.verifier = None
        # Vision-language models: deepinfer.multimodal.engine_images.EngineImages splices image
        # embeddings into the step's input embeddings.
        self.mm_embeds = None

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> StepResult:
        start = time.perf_counter()
        if output.is_empty:
            self._forget_rows(output)  # an empty step may still report finished requests
            if self.empty_step_hook is not None:
                self.empty_step_hook()
            return StepResult({}, step_time_s=0.0)
        # Decodes (one new token, or a short chunk: see _as_decode) first, then prefill chunks:
        # see paged_attention's layout.
        ordered = sorted(output.scheduled, key=lambda r: not self._as_decode(r))
        input_ids, positions, meta, sample_idx, sample_reqs = self.prepare_step(output, ordered)
        attn = self._attention_backend(meta)
        embeds = self.mm_embeds.input_embeds(self.model, ordered, input_ids) if self.mm_embeds is not None else None
        if embeds is None:
            hidden = self.model(input_ids, positions, attn)  # [T, hidden]
        else:
            hidden = self.model(input_ids, positions, attn, input_embeds=embeds)
        prompt_lps = (compute_prompt_logprobs(self.model, hidden, ordered)
                      if wants_prompt_logprobs(ordered) else {})
        if self.verifier is not None:  # samples every draft position too
            result = self.verifier.sample(self.model, hidden, ordered)
        else:
            result = StepResult({})
            if sample_reqs:
                logits = self.model.compute_logits(hidden[sample_idx])  # [N, vocab] fp32
                token_ids, result.logprobs = self.sampler.sample(logits, sample_reqs)
                result.sampled_token_ids = {r.request_id: t for r, t in zip(sample_reqs, token_ids)}
        result.prompt_logprobs = prompt_lps
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        result.step_time_s = time.perf_counter() - start
        return result

    def _attention_backend(self, meta: AttentionMetadata):
        """Per-head K/V cache -> PagedAttention; latent (MLA) cache -> PagedMLAAttention."""
        if getattr(self.cache.spec, "is_latent", False):
            from deepinfer.runtime.mla_attention import PagedMLAAttention
            return PagedMLAAttention(self.cache, meta, self.mla_kernel)
        if self.device.type == "cuda":  # FlashInfer or mask-free SDPA (runtime/cuda_attention.py)
            if getattr(self, "cuda_attention", None) is None:
                from deepinfer.runtime.cuda_attention import CudaAttentionBuilder
                self.cuda_attention = CudaAttentionBuilder(self.cache, self.num_heads)
            return self.cuda_attention.build(meta)
        return PagedAttention(self.cache, meta, self.num_heads, self.decode_kernel,
                              prefill_kernel=self.prefill_kernel)

    def _as_decode(self, r: ScheduledRequest) -> bool:
        return r.num_new_tokens == 1 or (self.decode_kernel is not None
                                         and r.num_new_tokens <= SHORT_CHUNK_TOKENS)

    def prepare_step(self, output: SchedulerOutput, ordered: list[ScheduledRequest]):
        """`_prepare(ordered)`, from the persistent rows for steps of `persistent_min_requests`
        requests or more (a few rows build faster as plain lists: 5 small tensors against ~15
        array ops; a row's blocks are compared, so skipped steps leave nothing stale)."""
        self._forget_rows(output)
        if self.input_batch is None or len(ordered) < self.persistent_min_requests:
            return self._prepare(ordered)
        return self.input_batch.prepare(ordered, self._as_decode, self._prefill_meta,
                                        need_mask=self._needs_decode_mask())

    def _needs_decode_mask(self) -> bool:
        """The C kernels read context_lens; SDPA needs a mask."""
        return self.decode_kernel is None and getattr(self, "mla_kernel", None) is None

    def _forget_rows(self, output: SchedulerOutput) -> None:
        if self.sampler.grammar is not None:  # a preempted request's matcher is rebuilt
            self.sampler.grammar.forget(output.finished_request_ids)
            self.sampler.grammar.forget(output.preempted_request_ids)
        if self.input_batch is not None:
            self.input_batch.forget(output.finished_request_ids)
            self.input_batch.forget(output.preempted_request_ids)

    def _prepare(self, ordered: list[ScheduledRequest]):
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_idx: list[int] = []
        sample_reqs: list[ScheduledRequest] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillChunkMetadata] = []
        # Decode rows must lead the flat batch: a short chunk after a prefill chunk (an order
        # sorted by num_new_tokens != 1 alone, as the draft runner does) stays a prefill chunk.
        leading = True
        for r in ordered:
            first = len(input_ids)
            p0 = r.num_computed_tokens
            input_ids.extend(r.token_ids)
            pos = range(p0, p0 + r.num_new_tokens)
            positions.extend(pos)
            slots.extend(r.block_ids[p // bs] * bs + p % bs for p in pos)
            if r.sample:
                sample_idx.append(len(input_ids) - 1)
                sample_reqs.append(r)
            leading = leading and self._as_decode(r)
            if leading:
                table = r.block_ids[:-(-r.context_len // bs)]
                for p in pos:  # token p sees positions 0..p (its own K/V is written first)
                    decode_tables.append(table)
                    decode_lens.append(p + 1)
            else:
                prefills.append(self._prefill_meta(r, first))
        dev = self.device
        decode = self._decode_meta(decode_tables, decode_lens) if decode_tables else None
        meta = AttentionMetadata(torch.tensor(slots, dtype=torch.long, device=dev), decode, prefills)
        return (torch.tensor(input_ids, dtype=torch.long, device=dev),
                torch.tensor(positions, dtype=torch.long, device=dev),
                meta, torch.tensor(sample_idx, dtype=torch.long, device=dev), sample_reqs)

    def _decode_meta(self, tables: list[list[int]], lens: list[int]) -> DecodeMetadata:
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        dev = self.device
        context_lens = torch.tensor(lens, dtype=torch.long, device=dev)
        block_ids = torch.tensor(padded, dtype=torch.long, device=dev).view(-1)
        mask = None
        if self._needs_decode_mask():
            ctx = torch.arange(width * self.block_size, device=dev)
            mask = (ctx.unsqueeze(0) < context_lens.unsqueeze(1))[:, None, None, :]  # [B, 1, 1, ctx]
        return DecodeMetadata(len(tables), block_ids, mask, context_lens)

    def _prefill_meta(self, r: ScheduledRequest, start: int) -> PrefillChunkMetadata:
        p0, x = r.num_computed_tokens, r.num_new_tokens
        if p0 == 0:
            return PrefillChunkMetadata(start, x, 0, None, None)
        dev = self.device
        num_blocks = -(-(p0 + x) // self.block_size)
        block_ids = torch.tensor(r.block_ids[:num_blocks], dtype=torch.long, device=dev)
        keys = torch.arange(p0 + x, device=dev).unsqueeze(0)
        queries = torch.arange(p0, p0 + x, device=dev).unsqueeze(1)
        return PrefillChunkMetadata(start, x, p0, block_ids, keys <= queries)
