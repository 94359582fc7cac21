"""Analytic step times: DeepSeek-V3 sizes, roofline regimes, all-to-all and KV capacity."""
from __future__ import annotations

from pathlib import Path

import pytest

from deepinfer.core.cost_model import ChunkShape
from deepinfer.sim.analytic_model import analytic_model
from deepinfer.sim.hardware import ACCELERATORS, accelerator
from deepinfer.sim.roofline import RooflineConfig, RooflineStepTime, kv_cache_blocks
from deepinfer.sim.step_time import ProfileStepTime, fitted_cost_model, load_cost_profile

PROFILE = str(Path(__file__).resolve().parents[2] / "benchmarks" / "results"
              / "cost_profile_smollm2_bf16_cpu_1thread.json")


def test_deepseek_v3_sizes():
    m = analytic_model("deepseek-v3")
    assert m.total_params == pytest.approx(671e9, rel=0.005)
    assert m.active_params == pytest.approx(37e9, rel=0.02)
    assert m.kv_bytes_per_token == 61 * (512 + 64) * 2  # bf16 MLA latent
    assert m.num_experts == 256 and m.num_experts_per_tok == 8 and m.num_moe_layers == 58


def test_every_listed_accelerator_resolves_and_unknown_raises():
    for name in ("H800", "H100", "H200", "B200", "GB200", "h800"):
        assert accelerator(name).hbm_bytes_per_s > 0
    assert accelerator("H200").hbm_bytes_per_s > accelerator("H100").hbm_bytes_per_s
    assert set(ACCELERATORS) >= {"H800", "H100", "H200", "B200", "GB200"}
    with pytest.raises(ValueError, match="unknown accelerator"):
        accelerator("TPU9")


def _step(config: RooflineConfig, accel: str = "H800") -> RooflineStepTime:
    return RooflineStepTime(analytic_model("deepseek-v3"), accelerator(accel), config)


def test_small_decode_is_memory_bound_big_prefill_compute_bound():
    step = _step(RooflineConfig(num_accelerators=8, ep_size=144, num_redundant_experts=32))
    small = step.breakdown([ChunkShape(1000, 1)] * 8)
    m, a, c = step.model, step.accel, step.config
    compute = 2 * m.active_params * 1 / (a.fp8_flops * c.mfu)
    assert small["linear"] > 10 * compute  # weights dominate a tiny batch
    big = _step(RooflineConfig(num_accelerators=8, ep_size=32)).breakdown([ChunkShape(0, 16384)] * 8)
    assert big["linear"] == pytest.approx(2 * m.active_params * 16384 / (a.fp8_flops * c.mfu))


def test_step_time_grows_with_batch_and_context_and_is_faster_on_b200():
    config = RooflineConfig(num_accelerators=8, ep_size=144)
    step = _step(config)
    times = [step.step_time_s([ChunkShape(4000, 1)] * b) for b in (64, 256, 1024)]
    assert times[0] < times[1] < times[2]
    assert step.step_time_s([ChunkShape(1000, 1)] * 256) < step.step_time_s([ChunkShape(8000, 1)] * 256)
    assert _step(config, "B200").step_time_s([ChunkShape(4000, 1)] * 256) < times[1]
    assert step.step_time_s([]) == 0.0


def test_node_dedup_cuts_prefill_all_to_all():
    chunks = [ChunkShape(0, 4096)] * 16
    per_expert = _step(RooflineConfig(num_accelerators=8, ep_size=32)).breakdown(chunks)
    per_node = _step(RooflineConfig(num_accelerators=8, ep_size=32, node_dedup=True)).breakdown(chunks)
    assert per_node["all_to_all"] < per_expert["all_to_all"]
    single = _step(RooflineConfig(num_accelerators=8, ep_size=8)).breakdown(chunks)
    assert single["all_to_all"] < per_expert["all_to_all"]  # all on NVLink


def test_kv_capacity_from_hbm():
    m, a = analytic_model("deepseek-v3"), accelerator("H800")
    decode = kv_cache_blocks(m, a, RooflineConfig(num_accelerators=8, ep_size=144), 64)
    prefill = kv_cache_blocks(m, a, RooflineConfig(num_accelerators=8, ep_size=32), 64)
    assert decode > prefill > 0  # fewer experts per GPU leave more HBM for KV
    with pytest.raises(ValueError, match="does not fit"):
        kv_cache_blocks(m, a, RooflineConfig(num_accelerators=8, ep_size=4), 64)


def test_fitted_cost_model_tracks_the_roofline():
    step = _step(RooflineConfig(num_accelerators=8, ep_size=144))
    fitted = fitted_cost_model(step, step.model.model_shape())
    for chunks in ([ChunkShape(2048, 1)] * 128, [ChunkShape(0, 2048)]):
        assert fitted.predict(chunks) == pytest.approx(step.step_time_s(chunks), rel=0.5)


def test_profile_step_time_is_the_engines_cost_model():
    model = load_cost_profile(PROFILE)
    step = ProfileStepTime(model, time_scale=2.0)
    chunks = [ChunkShape(100, 1), ChunkShape(0, 64)]
    assert step.step_time_s(chunks) == pytest.approx(2.0 * model.predict(chunks))
    assert step.kv_bytes_per_token == model.shape.kv_bytes_per_token
    with pytest.raises(ValueError, match="cannot read"):
        load_cost_profile("/nonexistent/profile.json")
