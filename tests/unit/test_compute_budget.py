"""Compute-aware step budget: decodes always fit, chunks fit the time budget, shrink with context,
end on block boundaries, and the first prefill always progresses. Pure and fast."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.core.compute_budget import ComputeAwarePolicy
from deepinfer.core.cost_model import ChunkShape, CostModel
from deepinfer.core.model_shape import ModelShape

SHAPE = ModelShape(num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, hidden_size=576,
                   active_params=106_168_320, kv_bytes_per_token=23_040,
                   weight_bytes=269_000_000)
COEF = {"linear_flops": 2e-12, "attention_flops": 6e-12, "bytes_moved": 1e-10,
        "num_requests": 3e-4, "step": 4e-3}
MODEL = CostModel(SHAPE, COEF)
BUDGET_S = 0.25


def policy(**kw) -> ComputeAwarePolicy:
    kw.setdefault("block_size", 16)
    kw.setdefault("min_chunk_tokens", 32)
    return ComputeAwarePolicy(MODEL, BUDGET_S, **kw)


def test_single_prefill_chunk_fills_but_never_exceeds_budget():
    budget = policy().new_step()
    x = budget.fit_chunk(0, 100_000)
    budget.consume(0, x)
    assert 32 < x < 100_000 and x % 16 == 0
    assert budget.predicted_time_s <= BUDGET_S
    # One more block would have broken the budget.
    assert MODEL.new_estimate().added_time_s(0, x + 16) > BUDGET_S


def test_chunk_sizes_fall_as_context_grows():
    sizes = []
    for context_len in range(0, 32_768, 2048):
        sizes.append(policy().new_step().fit_chunk(context_len, 100_000))
    assert all(a >= b for a, b in zip(sizes, sizes[1:]))
    assert sizes[-1] < sizes[0] / 2


def test_decodes_always_fit_and_are_charged():
    budget = policy().new_step()
    for _ in range(400):  # far more decode work than the budget allows
        assert budget.fit_chunk(4000, 1) == 1
        budget.consume(4000, 1)
    assert budget.predicted_time_s > BUDGET_S


def test_first_prefill_gets_min_chunk_even_when_decodes_used_the_budget():
    budget = policy().new_step()
    for _ in range(400):
        budget.consume(4000, 1)
    first = budget.fit_chunk(0, 1000)
    assert first == 32
    budget.consume(0, first)
    assert budget.fit_chunk(0, 1000) == 0  # a second prefill does not ride along
    assert budget.fit_chunk(0, 1) == 0  # nor a one-token prompt remainder after it


def test_short_prompt_is_taken_whole_and_min_chunk_is_capped_by_the_prompt():
    budget = policy().new_step()
    for _ in range(400):
        budget.consume(4000, 1)
    assert budget.fit_chunk(0, 7) == 7


def test_chunks_end_on_block_boundaries_unless_they_finish_the_prompt():
    p = policy(block_size=16, min_chunk_tokens=16)
    for context_len in (0, 5, 16, 100, 1000, 3333):
        x = p.new_step().fit_chunk(context_len, 100_000)
        assert (context_len + x) % 16 == 0
    fresh = p.new_step()
    assert fresh.fit_chunk(0, 37) == 37  # fits whole: no cut


def test_token_cap_limits_prefill_chunks():
    budget = policy(max_num_batched_tokens=64).new_step()
    budget.consume(10, 1)
    x = budget.fit_chunk(0, 10_000)
    assert x == 48  # 63 left, cut to the block boundary
    budget.consume(0, x)
    assert budget.fit_chunk(0, 10_000) == 0


def test_bad_arguments_raise():
    with pytest.raises(ValueError):
        ComputeAwarePolicy(MODEL, 0.0)
    with pytest.raises(ValueError):
        ComputeAwarePolicy(MODEL, 0.1, block_size=0)
    with pytest.raises(ValueError):
        ComputeAwarePolicy(MODEL, 0.1, min_chunk_tokens=0)
    assert policy().name == "compute-aware"


@settings(max_examples=120, deadline=None)
@given(decode_contexts=st.lists(st.integers(0, 8000), max_size=40),
       prefills=st.lists(st.tuples(st.integers(0, 8000), st.integers(1, 5000)), max_size=8),
       budget_ms=st.integers(5, 500))
def test_step_stays_within_budget_unless_one_min_chunk_alone_exceeds(decode_contexts, prefills,
                                                                     budget_ms):
    p = ComputeAwarePolicy(MODEL, budget_ms / 1000, block_size=16, min_chunk_tokens=32)
    budget = p.new_step()
    for ctx in decode_contexts:
        budget.consume(ctx, budget.fit_chunk(ctx, 1))
    granted = []
    for ctx, remaining in prefills:
        x = budget.fit_chunk(ctx, remaining)
        assert 0 <= x <= remaining
        if x:
            budget.consume(ctx, x)
            granted.append((ctx, x, remaining))
    if budget.predicted_time_s > p.step_time_budget_s:
        # Over budget only through the decodes plus at most one minimum first chunk.
        prefill_sizes = [x for _, x, _ in granted if x > 1]
        assert len(prefill_sizes) <= 1 and all(x <= 32 for x in prefill_sizes)
    if prefills:
        assert granted and granted[0][0] == prefills[0][0]  # the first prefill progressed


def test_online_calibration_scales_predictions_and_shrinks_chunks():
    p = policy()
    before = p.new_step().fit_chunk(0, 100_000)
    for _ in range(200):  # the device runs 1.5x slower than profiled
        budget = p.new_step()
        budget.consume(0, 64)
        p.observe_step(budget.predicted_time_s, 1.5 * budget.predicted_time_s / p.time_scale)
    assert p.time_scale == pytest.approx(1.5, rel=0.01)
    budget = p.new_step()
    after = budget.fit_chunk(0, 100_000)
    assert after < before
    budget.consume(0, after)
    raw = MODEL.predict([ChunkShape(0, after)])
    # Reported in measured seconds.
    assert budget.predicted_time_s == pytest.approx(p.time_scale * raw, rel=1e-9)
    assert budget.predicted_time_s <= BUDGET_S


def test_calibration_resists_outliers_and_can_be_disabled():
    p = policy()
    p.observe_step(0.1, 100.0)  # one 1000x outlier (a GC pause, a page fault storm)
    assert p.time_scale < 1.05
    off = policy(calibrate=False)
    off.observe_step(0.1, 0.2)
    off.observe_step(0.0, 0.2)  # nonsense input is ignored either way
    assert off.time_scale == 1.0
