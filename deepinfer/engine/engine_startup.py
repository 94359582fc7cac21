"""What an engine builds once at start: the device, the loaded model, the KV cache's size and
the step budget policy. Kept apart from the engine loop so the loop's file reads as the loop."""
from __future__ import annotations

import gc
import logging
import os

import torch

from deepinfer.core.step_budget import StepBudgetPolicy, TokenBudgetPolicy
from deepinfer.engine.engine_config import EngineConfig
from deepinfer.models.quantized_model import weight_bytes_by_format
from deepinfer.runtime.cpu_elementwise_kernels import install_elementwise_kernels
from deepinfer.runtime.cpu_linear_packing import pack_linear_weights
from deepinfer.runtime.kv_cache import blocks_that_fit, parse_memory
from deepinfer.runtime.model_source import ModelSource, load_model

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def freeze_startup_objects() -> None:
    """Move every object alive now (the model, tokenizer, tables: they live as long as the
    engine) out of the cyclic collector's sight, so a collection walks only what steps allocate
    (it took ~5% of a batch-1 decode step). Frozen objects in reference cycles are never
    collected: a process that builds and drops many engines (the test suite) sets
    DEEPINFER_GC_FREEZE=0."""
    if os.environ.get("DEEPINFER_GC_FREEZE", "1") != "0":
        gc.freeze()


def load_engine_model(source: ModelSource, config: EngineConfig, dtype: torch.dtype,
                      device: torch.device) -> torch.nn.Module:
    """The model in its serving form: on CPU, linear weights packed for oneDNN and the fused
    element-wise kernels installed."""
    model = load_model(source, dtype, device, config.quantization)
    if device.type == "cpu":
        logger.info("packed %d linear layers for oneDNN; fused kernels in %d modules",
                    pack_linear_weights(model), install_elementwise_kernels(model))
    logger.info("weights: %s", ", ".join(f"{fmt} {num / 2 ** 20:.1f} MiB" for fmt, num
                                          in sorted(weight_bytes_by_format(model).items())))
    return model


def attach_images(model: torch.nn.Module, device: torch.device, runner):
    """A vision-language model's image path (requests' images, the embedding cache, the
    runner's splice of image embeddings), or None for a text model."""
    if not hasattr(model, "encode_images"):
        return None
    from deepinfer.multimodal.engine_images import EngineImages
    images = EngineImages(model, device)
    runner.mm_embeds = images
    return images


def eos_token_ids(model_config, tokenizer) -> tuple[int, ...]:
    """The model's end-of-sequence ids and the tokenizer's, if it names another."""
    eos = set(model_config.eos_token_ids)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        eos.add(tokenizer.eos_token_id)
    return tuple(sorted(eos))


def num_blocks_for_memory(kv_cache_memory: str, spec, draft_spec) -> int:
    """Blocks `--kv-cache-memory` holds: with a drafter that keeps KV, each block also costs
    its draft block, so target + draft caches together stay within the flag."""
    memory = parse_memory(kv_cache_memory)
    bytes_per_block = spec.bytes_per_block + (draft_spec.bytes_per_block if draft_spec else 0)
    num_blocks = blocks_that_fit(memory, bytes_per_block)
    if draft_spec is not None:
        logger.info("KV cache memory %d B split: target %d B + draft %d B (%d blocks of "
                    "%d + %d B)", memory, num_blocks * spec.bytes_per_block,
                    num_blocks * draft_spec.bytes_per_block, num_blocks, spec.bytes_per_block,
                    draft_spec.bytes_per_block)
    return num_blocks


def fit_max_model_len(max_model_len: int, requested: int | None, kv_capacity_tokens: int) -> int:
    """A sequence longer than the whole KV cache could never finish: it would end early with
    finish_reason "length". An explicit --max-model-len (`requested`) beyond the cache is
    refused (as vLLM does); the model's own limit is lowered to what the cache holds."""
    if max_model_len <= kv_capacity_tokens:
        return max_model_len
    if requested is not None:
        raise ValueError(f"max_model_len {max_model_len} is larger than the KV cache "
                         f"({kv_capacity_tokens} tokens): raise --kv-cache-memory or lower "
                         "--max-model-len")
    logger.warning("max_model_len lowered from %d to %d tokens: the KV cache holds no more",
                   max_model_len, kv_capacity_tokens)
    return kv_capacity_tokens


def build_budget_policy(config: EngineConfig, runner, model_config) -> StepBudgetPolicy:
    if config.scheduler == "token-budget":
        return TokenBudgetPolicy(config.max_num_batched_tokens)
    from deepinfer.runtime.budget_factory import build_step_budget_policy
    return build_step_budget_policy(
        config.scheduler, max_num_batched_tokens=config.max_num_batched_tokens,
        step_time_budget_ms=config.step_time_budget_ms, cost_profile_path=config.cost_profile,
        runner=runner, model_config=model_config, block_size=config.block_size,
        dtype=config.dtype)
