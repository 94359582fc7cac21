"""MoE-aware cost features: active parameters = dense part + top-k (+ shared) experts; the
expert weight bytes a step reads grow with the distinct experts its tokens touch; MLA's KV
bytes per token are the latent entry. Pure: ModelConfig and the cost model, no torch."""
from __future__ import annotations

import math

import numpy as np
import pytest

from deepinfer.core.cost_model import CostModel, StepCostEstimate, ChunkShape, FEATURE_NAMES
from deepinfer.core.model_shape import ModelShape
from deepinfer.models.model_config import ModelConfig

DSV3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 1000, "hidden_size": 64,
    "intermediate_size": 96, "moe_intermediate_size": 24, "num_hidden_layers": 4,
    "num_attention_heads": 4, "n_routed_experts": 16, "n_shared_experts": 1,
    "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1,
    "q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
    "v_head_dim": 24, "max_position_embeddings": 512,
}


def test_deepseek_shape_counts_active_experts_and_latent_kv():
    config = ModelConfig.from_hf_config(DSV3)
    shape = ModelShape.from_model_config(config, 2)
    expert = 3 * 64 * 24
    assert shape.num_experts == 16 and shape.num_experts_per_tok == 2
    assert shape.expert_bytes == 3 * expert * 2  # three MoE layers (layer 0 is dense)
    assert shape.active_params == config.num_active_params()
    # Total minus active is exactly the 14 unchosen experts per MoE layer (+ the bias vectors).
    dense_part = config.num_params() - 2 * 1000 * 64 - 64  # embeddings, lm_head, final norm
    assert dense_part - shape.active_params == 3 * (14 * expert + 16)
    assert shape.kv_bytes_per_token == 4 * (32 + 8) * 2
    dense = ModelConfig.from_hf_config({**DSV3, "architectures": ["LlamaForCausalLM"],
                                        "num_key_value_heads": 4})
    assert ModelShape.from_model_config(dense, 2).num_experts == 0


def test_expert_bytes_read_grow_with_distinct_experts():
    shape = ModelShape.from_model_config(ModelConfig.from_hf_config(DSV3), 2)
    one = shape.weight_bytes_read(1)
    assert math.isclose(one, shape.dense_weight_bytes + 2 * shape.expert_bytes)
    reads = [shape.weight_bytes_read(n) for n in (1, 2, 8, 64, 4096)]
    assert all(a < b for a, b in zip(reads, reads[1:]))
    assert math.isclose(reads[-1], shape.weight_bytes, rel_tol=1e-9)
    old = {k: v for k, v in shape.to_dict().items() if k not in ("num_experts", "num_experts_per_tok", "expert_bytes")}
    assert ModelShape.from_dict(old).num_experts == 0  # profiles from before MoE still load


def test_moe_estimate_matches_features_and_chunk_fits():
    shape = ModelShape.from_model_config(ModelConfig.from_hf_config(DSV3), 2)
    coefficients = dict(zip(FEATURE_NAMES, (1e-9, 1e-10, 1e-7, 2e-9, 1e-4, 1e-3)))
    model = CostModel(shape, coefficients)
    chunks = [ChunkShape(40, 1), ChunkShape(0, 30), ChunkShape(100, 7)]
    by_features = float(np.dot(model.features(chunks), [coefficients[n] for n in FEATURE_NAMES]))
    assert math.isclose(model.predict(chunks), by_features, rel_tol=1e-9)
    # The expert term makes a bigger batch read more weights than a dense model would predict.
    fewer = model.features([ChunkShape(0, 1)])[2]
    more = model.features([ChunkShape(0, 50)])[2] - 50 * shape.kv_bytes_per_token
    assert more - shape.kv_bytes_per_token > fewer
    estimate = StepCostEstimate(model)
    estimate.add(10, 1)
    limit = 0.03
    n = estimate.max_new_tokens_within(0, 10_000, limit)
    assert n >= 2 and estimate.added_time_s(0, n) <= limit < estimate.added_time_s(0, n + 1)
