"""Cost model: features, incremental estimate, NNLS fit, profile round trip. Pure and fast."""
from __future__ import annotations

import itertools
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest

from deepinfer.core.cost_model import (FEATURE_NAMES, ChunkShape, CostModel, StepSample,
                                       prediction_error)
from deepinfer.core.least_squares import nonnegative_least_squares
from deepinfer.core.model_shape import ModelShape

# SmolLM2-135M-like sizes.
SMOL_CONFIG = SimpleNamespace(num_hidden_layers=30, hidden_size=576, num_attention_heads=9,
                              num_key_value_heads=3, head_dim=None, intermediate_size=1536,
                              vocab_size=49152, tie_word_embeddings=True)
SHAPE = ModelShape.from_model_config(SMOL_CONFIG, dtype_bytes=2)
TRUE_COEF = {"linear_flops": 2e-11, "attention_flops": 6e-11, "bytes_moved": 1e-10,
             "decode_kv_bytes": 4e-11, "num_requests": 3e-4, "step": 4e-3}


def random_batch(rng: np.random.Generator) -> tuple[ChunkShape, ...]:
    chunks = [ChunkShape(int(rng.integers(0, 3000)), 1) for _ in range(int(rng.integers(0, 12)))]
    for _ in range(int(rng.integers(0 if chunks else 1, 3))):
        chunks.append(ChunkShape(int(rng.integers(0, 3000)), int(rng.integers(2, 600))))
    return tuple(chunks)


def synthetic_samples(model: CostModel, n: int, noise: float, seed: int) -> list[StepSample]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        batch = random_batch(rng)
        out.append(StepSample(batch, model.predict(batch) * (1 + noise * rng.standard_normal())))
    return out


def test_model_shape_from_config_matches_smollm2_sizes():
    assert SHAPE.head_dim == 64
    assert SHAPE.active_params == 30 * (576 * 64 * (2 * 9 + 2 * 3) + 3 * 576 * 1536)
    assert SHAPE.kv_bytes_per_token == 2 * 30 * 3 * 64 * 2
    # All weights incl. the tied embedding: the model is named for ~135M parameters.
    assert 130e6 < SHAPE.weight_bytes / 2 < 140e6
    with pytest.raises(ValueError):
        ModelShape.from_model_config(SimpleNamespace(hidden_size=8), dtype_bytes=2)


def test_moe_config_counts_only_routed_experts_as_active():
    moe = SimpleNamespace(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                          num_key_value_heads=4, intermediate_size=256, moe_intermediate_size=32,
                          num_experts=8, num_experts_per_tok=2, vocab_size=100)
    shape = ModelShape.from_model_config(moe, dtype_bytes=4)
    attn = 64 * 16 * 16
    assert shape.active_params == 2 * (attn + 2 * 3 * 64 * 32 + 64 * 8)
    assert shape.weight_bytes == 4 * (2 * (attn + 8 * 3 * 64 * 32 + 64 * 8) + 2 * 100 * 64)


def test_incremental_estimate_equals_feature_dot_product():
    model = CostModel(SHAPE, TRUE_COEF)
    coef = np.array([TRUE_COEF[f] for f in FEATURE_NAMES])
    rng = np.random.default_rng(0)
    for _ in range(50):
        batch = random_batch(rng)
        estimate = model.new_estimate()
        for c in batch:
            estimate.add(c.context_len, c.num_new_tokens)
        assert estimate.predicted_time_s == pytest.approx(float(model.features(batch) @ coef),
                                                          rel=1e-9)
    assert model.predict(()) == 0.0


def test_attention_term_is_quadratic_in_chunk_size():
    model = CostModel(SHAPE, {"attention_flops": 1e-12})
    one = model.predict([ChunkShape(0, 100)])
    two = model.predict([ChunkShape(0, 200)])
    assert two == pytest.approx(4 * one)
    # After a context P, x new tokens cost x*(P + x/2) query-key pairs.
    assert model.predict([ChunkShape(1000, 100)]) == pytest.approx(one * 100 * 1050 / (100 * 50))


def test_decode_kv_bytes_charge_decodes_only():
    model = CostModel(SHAPE, {"decode_kv_bytes": 1e-10})
    decodes = [ChunkShape(63, 1)] * 7 + [ChunkShape(2559, 1)]
    expected = 1e-10 * SHAPE.kv_bytes_per_token * (7 * 64 + 2560)
    assert model.predict(decodes) == pytest.approx(expected)
    assert model.predict([ChunkShape(2559, 2)]) == 0.0  # a prefill chunk is not a decode
    estimate = model.new_estimate()
    assert estimate.added_time_s(2559, 1) == pytest.approx(1e-10 * SHAPE.kv_bytes_per_token
                                                          * 2560)


def test_fit_recovers_synthetic_coefficients_exactly_without_noise():
    truth = CostModel(SHAPE, TRUE_COEF)
    fitted = CostModel.fit(SHAPE, synthetic_samples(truth, 60, noise=0.0, seed=1))
    for name in FEATURE_NAMES:
        assert fitted.coefficients[name] == pytest.approx(TRUE_COEF[name], rel=1e-4), name


def test_fit_with_noise_predicts_held_out_steps():
    truth = CostModel(SHAPE, TRUE_COEF)
    fitted = CostModel.fit(SHAPE, synthetic_samples(truth, 200, noise=0.03, seed=2))
    err = fitted.evaluate(synthetic_samples(truth, 200, noise=0.03, seed=3))
    assert err.num_samples == 200
    assert err.median_abs_pct_error < 4.0 and err.p90_abs_pct_error < 8.0
    assert fitted.coefficients["attention_flops"] == pytest.approx(TRUE_COEF["attention_flops"],
                                                                   rel=0.1)


def test_fit_keeps_coefficients_non_negative():
    # Times that *fall* with tokens would need a negative linear coefficient.
    samples = [StepSample((ChunkShape(0, x),), 1.0 - 1e-4 * x) for x in range(2, 400, 7)]
    fitted = CostModel.fit(SHAPE, samples)
    assert all(v >= 0 for v in fitted.coefficients.values())
    assert fitted.coefficients["linear_flops"] == 0.0


def test_nnls_matches_brute_force_over_active_sets():
    rng = np.random.default_rng(4)
    for _ in range(20):
        a = rng.standard_normal((12, 4)) * rng.uniform(0.01, 100, size=4)
        b = rng.standard_normal(12)
        best = math.inf
        for k in range(5):
            for cols in itertools.combinations(range(4), k):
                x = np.zeros(4)
                if cols:
                    x[list(cols)] = np.linalg.lstsq(a[:, cols], b, rcond=None)[0]
                if (x >= 0).all():
                    best = min(best, float(np.linalg.norm(a @ x - b)))
        x = nonnegative_least_squares(a, b)
        assert (x >= 0).all()
        assert float(np.linalg.norm(a @ x - b)) == pytest.approx(best, rel=1e-7, abs=1e-9)


def test_max_new_tokens_within_is_the_largest_fitting_chunk():
    model = CostModel(SHAPE, TRUE_COEF)
    rng = np.random.default_rng(5)
    for _ in range(200):
        estimate = model.new_estimate()
        for _ in range(int(rng.integers(0, 4))):
            estimate.add(int(rng.integers(0, 2000)), 1)
        p, limit = int(rng.integers(0, 4000)), float(rng.uniform(0, 0.5))
        x = estimate.max_new_tokens_within(p, 5000, limit)
        assert 0 <= x <= 5000
        if x > 0:
            assert estimate.added_time_s(p, x) <= limit
        if x < 5000:
            assert estimate.added_time_s(p, x + 1) > limit


def test_profile_round_trips_through_json():
    truth = CostModel(SHAPE, TRUE_COEF, metadata={"model": "smol", "dtype": "bfloat16"})
    samples = synthetic_samples(truth, 30, noise=0.0, seed=6)
    truth.holdout_error = truth.evaluate(samples)
    loaded = CostModel.from_dict(json.loads(json.dumps(truth.to_dict())))
    assert loaded.coefficients == truth.coefficients
    assert loaded.shape == SHAPE and loaded.metadata["model"] == "smol"
    assert loaded.holdout_error == truth.holdout_error
    assert "holdout_p90_abs_pct_error" in truth.to_dict()
    with pytest.raises(ValueError):
        CostModel.from_dict({"format": "something-else"})
    with pytest.raises(ValueError):
        CostModel(SHAPE, {"step": -1.0})
    with pytest.raises(ValueError):
        CostModel(SHAPE, {"warp_drive": 1.0})


def test_prediction_error_percentiles():
    err = prediction_error([1.1, 0.9, 2.0, 1.0], [1.0, 1.0, 1.0, 1.0])
    assert err.median_abs_pct_error == pytest.approx(10.0)
    assert err.p90_abs_pct_error > 10.0
    with pytest.raises(ValueError):
        prediction_error([1.0], [0.0])


def test_model_shape_agrees_with_model_config_counts():
    from deepinfer.models.model_config import ModelConfig  # torch-free; must import, not skip
    cfg = ModelConfig.from_hf_config({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576,
        "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "tie_word_embeddings": True})
    shape = ModelShape.from_model_config(cfg, dtype_bytes=2)
    assert shape.active_params == cfg.num_active_params()
    assert shape.weight_bytes == 2 * cfg.num_params()
    assert shape.kv_bytes_per_token == cfg.kv_bytes_per_token(2)
    # The attribute-only path (no count methods) lands within a fraction of a percent.
    assert abs(SHAPE.active_params - shape.active_params) / shape.active_params < 0.01
