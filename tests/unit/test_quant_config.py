"""quantization_config parsing (block-scaled FP8 as DeepSeek and Qwen3 release it) and the
perplexity benchmark's sliding windows: pure logic, no model."""
from __future__ import annotations

import pytest

from deepinfer.bench.errors import BenchError
from deepinfer.bench.perplexity import sliding_windows
from deepinfer.models.model_config import ModelConfig
from deepinfer.quant.quant_config import Fp8BlockQuantConfig, quant_config_from_hf

DEEPSEEK = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [128, 128]}


def test_release_configs_parse():
    assert quant_config_from_hf(DEEPSEEK) == Fp8BlockQuantConfig((128, 128), ())
    qwen = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
            "modules_to_not_convert": ["lm_head", "model.layers.0.mlp.gate"]}
    cfg = quant_config_from_hf(qwen)
    assert cfg.modules_to_not_convert == ("lm_head", "model.layers.0.mlp.gate")
    assert quant_config_from_hf(None) is None and quant_config_from_hf({}) is None
    assert quant_config_from_hf({**DEEPSEEK, "weight_block_size": [64, 32]}).weight_block_size == (64, 32)
    assert quant_config_from_hf({**DEEPSEEK, "ignored_layers": ["lm_head"]}).skips("lm_head")


def test_skips_matches_dotted_paths_only():
    cfg = Fp8BlockQuantConfig((128, 128), ("mlp.gate", "model.layers.1", "lm_head"))
    assert cfg.skips("model.layers.3.mlp.gate") and cfg.skips("lm_head")
    assert cfg.skips("model.layers.1.self_attn.q_proj")
    assert not cfg.skips("model.layers.3.mlp.gate_proj")
    assert not cfg.skips("model.layers.11.self_attn.q_proj")


@pytest.mark.parametrize("change, message", [
    ({"quant_method": "awq"}, "quant_method"),
    ({"quant_method": None}, "quant_method"),
    ({"fmt": "e5m2"}, "fmt"),
    ({"activation_scheme": "static"}, "activation_scheme"),
    ({"weight_block_size": None}, "weight_block_size"),
    ({"weight_block_size": [128, 0]}, "weight_block_size"),
    ({"weight_block_size": [128, True]}, "weight_block_size"),
    ({"weight_block_size": [128, 128, 1]}, "weight_block_size"),
    ({"kv_cache_scheme": "fp8"}, "kv_cache_scheme"),
    ({"modules_to_not_convert": "lm_head"}, "modules_to_not_convert"),
])
def test_unsupported_settings_name_themselves(change, message):
    with pytest.raises(ValueError, match=message):
        quant_config_from_hf({**DEEPSEEK, **change})


def test_a_quantization_config_that_is_no_object_is_refused():
    with pytest.raises(ValueError, match="object"):
        quant_config_from_hf(["fp8"])


def test_model_config_carries_the_quantization():
    hf = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 256, "hidden_size": 64,
          "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "quantization_config": DEEPSEEK}
    assert ModelConfig.from_hf_config(hf).quantization == Fp8BlockQuantConfig()
    assert ModelConfig.from_hf_config({**hf, "quantization_config": None}).quantization is None
    with pytest.raises(ValueError, match="quant_method"):
        ModelConfig.from_hf_config({**hf, "quantization_config": {"quant_method": "bitsandbytes"}})


@pytest.mark.parametrize("num_tokens, context, stride", [
    (2, 2, 1), (10, 4, 2), (10, 4, 3), (11, 4, 3), (100, 32, 16), (100, 200, 50), (37, 8, 1)])
def test_windows_score_every_token_after_the_first_once(num_tokens, context, stride):
    windows = sliding_windows(num_tokens, context, stride)
    scored = [t for w in windows for t in range(w.end - w.num_scored, w.end)]
    assert scored == list(range(1, num_tokens))
    for w in windows:
        assert 0 < w.end - w.begin <= context and 1 <= w.num_scored <= w.end - w.begin
        assert w.end - w.num_scored > w.begin  # a scored token has context in its window


@pytest.mark.parametrize("num_tokens, context, stride", [(1, 4, 2), (10, 1, 1), (10, 4, 0),
                                                         (10, 4, 4), (10, 4, 5)])
def test_bad_windows_are_bench_errors(num_tokens, context, stride):
    with pytest.raises(BenchError):
        sliding_windows(num_tokens, context, stride)
