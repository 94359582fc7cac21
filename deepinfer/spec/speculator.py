"""Wires speculative decoding into an engine: builds the drafter and the runner's verifier,
and after every step asks the drafter for the next step's drafts.

    engine step:  schedule (verifications of 1 + k tokens among the batch)
                  -> runner.execute (SpecVerifier samples every draft position)
                  -> scheduler.update (accepted tokens appended, rejected KV rolled back)
                  -> Speculator.propose (drafts for the next step -> Request.spec_token_ids)
"""
from __future__ import annotations

import dataclasses
import logging
import os

import torch

from deepinfer.core.request import RequestStatus
from deepinfer.core.scheduler import Scheduler
from deepinfer.core.scheduler_output import SchedulerOutput
from deepinfer.spec.draft_backoff import DraftBackoff
from deepinfer.spec.drafter import DraftRequest, Drafter
from deepinfer.spec.spec_config import SpeculativeConfig

logger = logging.getLogger(__name__)


class Speculator:
    def __init__(self, config: SpeculativeConfig, drafter: Drafter, scheduler: Scheduler,
                 backoff: DraftBackoff | None = None) -> None:
        self.config = config
        self.drafter = drafter
        self.scheduler = scheduler
        self.backoff = backoff or DraftBackoff()

    def forget(self, request_ids: list[str]) -> None:
        """Drop drafter state of these requests (e.g. a failed step was undone for them:
        they are recomputed and drafted afresh)."""
        self.drafter.remove(request_ids)
        self.backoff.remove(request_ids)

    def propose(self, output: SchedulerOutput) -> None:
        """After `output` ran and was applied: draft for every request it computed tokens
        for that is still running (requests mid-prefill only let a drafter catch up)."""
        gone = output.preempted_request_ids + output.finished_request_ids
        self.drafter.remove(gone)
        self.backoff.remove(gone)
        scheduler = self.scheduler
        requests = []
        for sched in output.scheduled:
            request = scheduler.requests.get(sched.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            if sched.num_draft_tokens:  # accepted = emitted tokens beyond the step's own one
                num_emitted = request.num_computed_tokens - sched.num_computed_tokens
                self.backoff.observe(request.request_id, sched.num_draft_tokens, num_emitted - 1)
            requests.append(DraftRequest(
                request_id=request.request_id, token_ids=request.all_token_ids,
                num_computed_tokens=request.num_computed_tokens,
                num_step_tokens=request.num_computed_tokens - sched.num_computed_tokens,
                block_ids=scheduler.kv.block_ids(request.request_id),
                sampling_params=request.sampling_params,
                num_output_tokens=request.num_output_tokens,
                max_num_drafts=scheduler.max_num_drafts(request)
                if self.backoff.allow(request.request_id) else 0))
        if not requests:
            return
        for request_id, token_ids in self.drafter.propose(requests).items():
            scheduler.set_draft_tokens(request_id, token_ids)


def build_speculator(config: SpeculativeConfig, engine) -> Speculator:
    """The drafter for `config` on a constructed LLMEngine (its scheduler, runner and cache
    exist); installs the verifier on the engine's runner."""
    from deepinfer.spec.verifier import SpecVerifier

    on_hidden = None
    if config.method == "ngram":
        from deepinfer.spec.ngram import NgramDrafter
        drafter = NgramDrafter(config.num_speculative_tokens, config.prompt_lookup_min,
                               config.prompt_lookup_max)
    elif config.method == "draft_model":
        drafter = _build_draft_model(config, engine)
    else:
        drafter = _build_mtp(config, engine)
        on_hidden = drafter.observe
    engine.runner.verifier = SpecVerifier(engine.runner.sampler, drafter, on_hidden)
    return Speculator(config, drafter, engine.scheduler)


def draft_kv_cache_spec(config: SpeculativeConfig, source, model_config, block_size: int,
                        dtype: torch.dtype):
    """The layout of the drafter's own KV cache (None for n-gram drafts, which keep none).
    It has one block per target block (same block ids), so each target block costs the
    target's plus this spec's bytes: the engine sizes both from one `--kv-cache-memory`."""
    from deepinfer.runtime.kv_cache_spec import kv_cache_spec_for

    if config.method == "ngram":
        return None
    if config.method == "draft_model":
        if config.model is not None:
            from deepinfer.runtime.model_source import resolve_model
            source = resolve_model(config.model)
        return kv_cache_spec_for(source.config, block_size, dtype)
    # MTP: one decoder layer of the target's own kind
    return kv_cache_spec_for(dataclasses.replace(model_config, num_hidden_layers=1), block_size,
                             dtype)


def _draft_runner(model, model_config, engine):
    from deepinfer.runtime.kv_cache_spec import allocate_kv_cache, kv_cache_spec_for
    from deepinfer.spec.draft_runner import DraftRunner

    spec = kv_cache_spec_for(model_config, engine.config.block_size, engine.dtype)
    if spec != engine.draft_kv_spec:  # the engine sized its blocks for engine.draft_kv_spec
        raise RuntimeError(f"draft KV layout {spec} differs from the one the KV cache memory "
                           f"was split for ({engine.draft_kv_spec})")
    cache = allocate_kv_cache(spec, engine.cache.num_blocks, engine.device)
    return DraftRunner(model, cache, engine.device, engine.config.seed)


def _build_draft_model(config: SpeculativeConfig, engine):
    from deepinfer.runtime.model_source import load_model, resolve_model
    from deepinfer.spec.draft_model import DraftModelDrafter

    source = engine.source if config.model is None else resolve_model(config.model)
    target_vocab = engine.model_config.vocab_size
    if source.config.vocab_size > target_vocab:
        raise ValueError(f"draft model vocabulary ({source.config.vocab_size}) is larger than "
                         f"the target's ({target_vocab}): not the same tokenizer")
    if source.config.max_position_embeddings < engine.max_model_len:
        raise ValueError(f"draft model handles {source.config.max_position_embeddings} positions, "
                         f"fewer than max_model_len ({engine.max_model_len}): lower --max-model-len")
    if os.path.realpath(source.path) == os.path.realpath(engine.source.path):
        model = engine.model  # drafting for itself: share the weights, own KV cache
    else:
        model = load_model(source, engine.dtype, engine.device)
        if engine.device.type == "cpu":
            from deepinfer.runtime.cpu_linear_packing import pack_linear_weights
            pack_linear_weights(model)
    logger.info("draft model %s, %d speculative tokens", source.name, config.num_speculative_tokens)
    return DraftModelDrafter(_draft_runner(model, source.config, engine),
                             config.num_speculative_tokens, target_vocab)


def _build_mtp(config: SpeculativeConfig, engine):
    from deepinfer.models.deepseek_v3 import DeepseekV3MTP, iter_mtp_weights
    from deepinfer.spec.mtp_drafter import MTPDrafter

    model_config = engine.model_config
    num_mtp = num_nextn_predict_layers(engine.source)
    if model_config.architecture != "deepseek_v3" or num_mtp < 1:
        raise ValueError("speculative method 'mtp' needs a DeepSeek-V3 checkpoint with "
                         "multi-token-prediction layers (num_nextn_predict_layers >= 1)")
    if model_config.quantization is not None:  # its FP8 tensors would load as raw values
        raise ValueError("speculative method 'mtp' is not supported with FP8 checkpoints yet")
    weights = list(iter_mtp_weights(engine.source.checkpoint, model_config.num_hidden_layers))
    if not weights:
        raise ValueError(f"speculative method 'mtp': the checkpoint has no multi-token-prediction "
                         f"layers (no model.layers.{model_config.num_hidden_layers}.* tensors)")
    with torch.device(engine.device):
        model = DeepseekV3MTP(model_config, engine.dtype)
    model.load_weights(weights)
    model.eval()
    cache_config = dataclasses.replace(model_config, num_hidden_layers=1)
    logger.info("MTP drafter: layer %d of the checkpoint, %d speculative tokens",
                model_config.num_hidden_layers, config.num_speculative_tokens)
    return MTPDrafter(_draft_runner(model, cache_config, engine), config.num_speculative_tokens,
                      model_config.vocab_size)


def num_nextn_predict_layers(source) -> int:
    """`num_nextn_predict_layers` from a Hugging Face checkpoint's config.json (0 if absent)."""
    import json

    path = os.path.join(source.path, "config.json")
    if not os.path.isfile(path):
        return 0
    with open(path, encoding="utf-8") as f:
        return int(json.load(f).get("num_nextn_predict_layers") or 0)
