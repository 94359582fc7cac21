"""Profiler and budget factory against a fake runner whose step time follows a known cost
model: the fit recovers it, held-out error is reported, start-up profiles are cached."""
from __future__ import annotations

import json
import random

import pytest
import torch

from deepinfer.core.compute_budget import ComputeAwarePolicy
from deepinfer.core.cost_model import ChunkShape, CostModel
from deepinfer.core.model_shape import ModelShape
from deepinfer.core.scheduler_output import SchedulerOutput, StepResult
from deepinfer.core.step_budget import TokenBudgetPolicy
from deepinfer.runtime import budget_factory
from deepinfer.runtime.budget_factory import build_step_budget_policy, load_cost_profile
from deepinfer.runtime.profiler import QUICK_GRID, StepProfiler, grid_with, profile_cost_model

CONFIG = type("Cfg", (), dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, intermediate_size=128,
                              vocab_size=1000, tie_word_embeddings=True))()
SHAPE = ModelShape.from_model_config(CONFIG, dtype_bytes=2)
TRUTH = CostModel(SHAPE, {"linear_flops": 1e-9, "attention_flops": 3e-9, "bytes_moved": 2e-10,
                          "decode_kv_bytes": 1e-9, "num_requests": 2e-4, "step": 3e-3})


class FakeCache:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.kv = torch.zeros(1, 2, num_blocks, 16, 1, 4)
        self.written: set[int] = set()

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        return self.kv[:, :, block_ids].clone()

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        self.kv[:, :, block_ids] = data
        self.written.update(block_ids)


class FakeRunner:
    """Step time = TRUTH's prediction with a little multiplicative noise."""

    def __init__(self, num_blocks: int = 2048, noise: float = 0.02) -> None:
        self.block_size = 16
        self.cache = FakeCache(num_blocks)
        self.device = torch.device("cpu")
        self.noise = noise
        self.rng = random.Random(0)
        self.num_executed = 0
        self.seen_ids: set[str] = set()

    def execute(self, output: SchedulerOutput) -> StepResult:
        if output.is_empty:
            return StepResult({})
        self.num_executed += 1
        for s in output.scheduled:
            assert len(s.block_ids) * self.block_size >= s.context_len
            assert len(set(s.block_ids)) == len(s.block_ids)
            assert set(s.block_ids) <= self.cache.written  # no read of never-written memory
            self.seen_ids.add(s.request_id)
        chunks = [ChunkShape(s.num_computed_tokens, s.num_new_tokens) for s in output.scheduled]
        t = TRUTH.predict(chunks) * (1 + self.noise * self.rng.uniform(-1, 1))
        return StepResult({s.request_id: 0 for s in output.scheduled if s.sample}, step_time_s=t)


def test_profile_recovers_cost_model_and_reports_holdout_error():
    model = profile_cost_model(FakeRunner(), SHAPE, 1000, QUICK_GRID, metadata={"model": "fake"})
    err = model.holdout_error
    assert err is not None and err.num_samples >= 5
    assert err.median_abs_pct_error < 3.0 and err.p90_abs_pct_error < 6.0
    probe = [ChunkShape(1500, 200)] + [ChunkShape(900, 1)] * 10
    assert model.predict(probe) == pytest.approx(TRUTH.predict(probe), rel=0.05)
    data = model.to_dict()
    assert data["holdout_median_abs_pct_error"] == err.median_abs_pct_error
    assert data["metadata"]["model"] == "fake" and data["metadata"]["grid"] == "quick"
    assert len(data["metadata"]["samples"]) == (data["metadata"]["num_train_steps"]
                                                + data["metadata"]["num_holdout_steps"])


def test_profiler_skips_batches_larger_than_the_cache_and_repeats_in_rounds():
    runner = FakeRunner(num_blocks=100)  # 1600 tokens: the 2048-context shapes cannot run
    grid = grid_with(QUICK_GRID, num_repeats=2, num_warmup=1)
    batches = grid.batches(StepProfiler(runner, 1000).max_tokens_per_request)
    assert batches and all(c.context_len + c.num_new_tokens <= 1600 for b in batches for c in b)
    samples = StepProfiler(runner, 1000).run(batches, 2, 1)
    assert len(samples) == len(batches)
    assert runner.num_executed == 3 * len(batches) + 2  # + the runner warm-up (1 + 1)
    assert all(s.step_time_s > 0 for s in samples)


def test_factory_token_budget_and_bad_kind():
    policy = build_step_budget_policy("token-budget", max_num_batched_tokens=512,
                                      step_time_budget_ms=None, cost_profile_path=None,
                                      runner=None, model_config=CONFIG, block_size=16,
                                      dtype="bfloat16")
    assert isinstance(policy, TokenBudgetPolicy) and policy.max_num_batched_tokens == 512
    with pytest.raises(ValueError, match="unknown scheduler"):
        build_step_budget_policy("fastest", max_num_batched_tokens=512, step_time_budget_ms=None,
                                 cost_profile_path=None, runner=None, model_config=CONFIG,
                                 block_size=16, dtype="bfloat16")


def test_factory_compute_aware_from_profile_file(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(TRUTH.to_dict()))
    policy = build_step_budget_policy("compute-aware", max_num_batched_tokens=4096,
                                      step_time_budget_ms=50.0, cost_profile_path=str(path),
                                      runner=None, model_config=CONFIG, block_size=16,
                                      dtype="bfloat16")
    assert isinstance(policy, ComputeAwarePolicy)
    assert policy.step_time_budget_s == pytest.approx(0.05)
    assert policy.cost_model.coefficients == TRUTH.coefficients
    assert policy.min_chunk_tokens % 16 == 0 and policy.max_num_batched_tokens == 4096
    # Default budget: what one max_num_batched_tokens prefill chunk is predicted to cost.
    default = build_step_budget_policy("compute-aware", max_num_batched_tokens=256,
                                       step_time_budget_ms=None, cost_profile_path=str(path),
                                       runner=None, model_config=CONFIG, block_size=16,
                                       dtype="bfloat16")
    assert default.step_time_budget_s == pytest.approx(TRUTH.predict([ChunkShape(0, 256)]))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read cost profile"):
        load_cost_profile(str(bad))


def test_startup_profile_is_cached_per_shape_dtype_device(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPINFER_PROFILE_DIR", str(tmp_path))
    monkeypatch.setattr(budget_factory, "QUICK_GRID",
                        grid_with(QUICK_GRID, num_repeats=1, num_ragged=2))
    kwargs = dict(max_num_batched_tokens=512, step_time_budget_ms=40.0, cost_profile_path=None,
                  model_config=CONFIG, block_size=16, dtype="bfloat16")
    first_runner = FakeRunner()
    first = build_step_budget_policy("compute-aware", runner=first_runner, **kwargs)
    assert first_runner.num_executed > 0
    files = list(tmp_path.iterdir())
    assert len(files) == 1 and "bfloat16" in files[0].name
    second_runner = FakeRunner()
    second = build_step_budget_policy("compute-aware", runner=second_runner, **kwargs)
    assert second_runner.num_executed == 0  # served from the cache
    assert second.cost_model.coefficients == pytest.approx(first.cost_model.coefficients)


def test_profile_is_piecewise_when_the_runner_has_a_fused_decode_stack():
    """A runner whose model sends decode-only steps of <= 8 rows to a decode stack (cheaper
    per row): the quick grid measures both sides of the limit and the profile keeps both."""
    from deepinfer.core.cost_model import SmallDecodeRegime
    from deepinfer.runtime.profiler import small_decode_rows

    stack = CostModel(SHAPE, {"linear_flops": 5e-10, "bytes_moved": 1e-10, "step": 1e-3})
    truth = CostModel(SHAPE, TRUTH.coefficients, small_decode=SmallDecodeRegime(8, stack))

    class StackRunner(FakeRunner):
        model = type("M", (), {"model": type("Inner", (), {"decode_stack": object()})()})()

        def execute(self, output):
            result = super().execute(output)
            if not output.is_empty:
                chunks = [ChunkShape(s.num_computed_tokens, s.num_new_tokens)
                          for s in output.scheduled]
                result.step_time_s = truth.predict(chunks)
            return result

    assert small_decode_rows(FakeRunner()) is None and small_decode_rows(StackRunner()) == 8
    model = profile_cost_model(StackRunner(), SHAPE, 1000, QUICK_GRID)
    assert model.small_decode is not None and model.metadata["small_decode_rows"] == 8
    for step in ([ChunkShape(900, 1)] * 4, [ChunkShape(900, 1)] * 16,
                 [ChunkShape(1500, 200)] + [ChunkShape(900, 1)] * 3):
        assert model.predict(step) == pytest.approx(truth.predict(step), rel=0.02)
    assert CostModel.from_dict(json.loads(json.dumps(model.to_dict()))).small_decode is not None


def test_profile_samples_record_cpu_seconds():
    model = profile_cost_model(FakeRunner(), SHAPE, 1000, grid_with(QUICK_GRID, num_ragged=2))
    samples = model.metadata["samples"]
    assert samples and all(s["cpu_s"] >= 0.0 for s in samples)
