"""ModelConfig parsing of HF config dicts and its size formulas (pure: no torch needed)."""
from __future__ import annotations

import pytest

from deepinfer.models.model_config import ModelConfig

SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
    "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0, "max_position_embeddings": 8192, "tie_word_embeddings": True,
    "bos_token_id": 1, "eos_token_id": 2,
}


def test_smollm2_parameter_count_matches_published_size():
    cfg = ModelConfig.from_hf_config(SMOLLM2_135M)
    assert cfg.head_dim == 64 and cfg.rope_scaling is None and cfg.eos_token_ids == (2,)
    assert cfg.num_params() == 134_515_008  # HF model card / sum of the safetensors shapes
    assert cfg.num_active_params() == 30 * 3_540_096
    assert cfg.kv_bytes_per_token(2) == 2 * 30 * 3 * 64 * 2


def test_rope_parameters_transformers5_style():
    cfg = ModelConfig.from_hf_config({**SMOLLM2_135M, "rope_theta": None, "rope_parameters": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192, "rope_theta": 500000.0}})
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    plain = ModelConfig.from_hf_config({**SMOLLM2_135M, "rope_theta": None,
                                        "rope_parameters": {"rope_type": "default", "rope_theta": 7.0}})
    assert plain.rope_theta == 7.0 and plain.rope_scaling is None


def test_legacy_rope_scaling_type_key():
    cfg = ModelConfig.from_hf_config({**SMOLLM2_135M, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_qwen_features_and_eos_lists():
    qwen2 = ModelConfig.from_hf_config({**SMOLLM2_135M, "architectures": ["Qwen2ForCausalLM"],
                                        "model_type": "qwen2", "eos_token_id": [2, 7, 2]})
    assert qwen2.architecture == "qwen2" and qwen2.attention_bias and not qwen2.o_proj_bias
    assert qwen2.eos_token_ids == (2, 7)  # deduplicated, order kept
    qwen3 = ModelConfig.from_hf_config({**SMOLLM2_135M, "architectures": ["Qwen3ForCausalLM"],
                                        "model_type": "qwen3", "head_dim": 128})
    assert qwen3.qk_norm and qwen3.head_dim == 128 and not qwen3.attention_bias
    assert qwen3.num_layer_params() - ModelConfig.from_hf_config(
        {**SMOLLM2_135M, "head_dim": 128}).num_layer_params() == 2 * 128  # q_norm + k_norm


def test_mistral_records_sliding_window():
    cfg = ModelConfig.from_hf_config({**SMOLLM2_135M, "architectures": ["MistralForCausalLM"],
                                      "model_type": "mistral", "sliding_window": 4096})
    assert cfg.architecture == "mistral" and cfg.sliding_window == 4096


@pytest.mark.parametrize("bad, match", [
    ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "unsupported"),
    ({"num_key_value_heads": 4}, "multiple"),
    ({"mlp_bias": True}, "mlp_bias"),
])
def test_bad_configs_raise_value_error(bad, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_config({**SMOLLM2_135M, **bad})
