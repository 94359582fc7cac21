"""Piecewise cost model: small decode-only steps (the CPU engine's fused decode stack) cost by
their own coefficients; the incremental estimate follows the regime a step is in. Pure, fast."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from deepinfer.core.cost_model import ChunkShape, CostModel, SmallDecodeRegime, StepSample
from tests.unit.test_cost_model import SHAPE, TRUE_COEF, random_batch

# The stack: ~1.5x cheaper per decode token, no per-request Python overhead.
STACK_COEF = {"linear_flops": TRUE_COEF["linear_flops"] / 1.5, "bytes_moved": 6e-11,
              "decode_kv_bytes": 3e-11, "step": 1e-3}
TRUTH = CostModel(SHAPE, TRUE_COEF, small_decode=SmallDecodeRegime(8, CostModel(SHAPE, STACK_COEF)))


def grid_samples(seed: int = 0, noise: float = 0.01) -> list[StepSample]:
    """Decode batches of 1..32 rows at three contexts, plus random mixed / prefill steps."""
    rng = np.random.default_rng(seed)
    batches = [tuple(ChunkShape(c, 1) for _ in range(b))
               for b, c in itertools.product((1, 2, 4, 8, 12, 16, 32), (64, 1024, 2048))]
    batches += [random_batch(rng) for _ in range(40)]
    return [StepSample(b, TRUTH.predict(b) * (1 + noise * rng.standard_normal())) for b in batches]


def test_regime_applies_to_small_decode_only_steps():
    regime = TRUTH.small_decode
    assert regime.applies([ChunkShape(10, 1)] * 8)
    assert not regime.applies([ChunkShape(10, 1)] * 9)
    assert not regime.applies([ChunkShape(10, 1), ChunkShape(0, 2)])
    assert not regime.applies([])
    # The regime's own prediction is used: cheaper than the main coefficients would say.
    step = [ChunkShape(500, 1)] * 4
    assert TRUTH.predict(step) == pytest.approx(CostModel(SHAPE, STACK_COEF).predict(step))
    assert TRUTH.predict(step) < CostModel(SHAPE, TRUE_COEF).predict(step)


def test_piecewise_fit_recovers_both_regimes_where_one_linear_fit_cannot():
    train, test = grid_samples(0), grid_samples(1, noise=0.0)
    piecewise = CostModel.fit_piecewise(SHAPE, train, 8)
    single = CostModel.fit(SHAPE, train)
    assert piecewise.small_decode is not None and piecewise.small_decode.max_rows == 8
    small = [s for s in test if TRUTH.small_decode.applies(s.chunks)]
    big_decode = [s for s in test if all(c.num_new_tokens == 1 for c in s.chunks)
                  and len(s.chunks) > 8]
    for subset in (small, big_decode, test):
        assert piecewise.evaluate(subset).p90_abs_pct_error < 3.0
    # One fit through both regimes is off on the decode steps (what the issue measured).
    assert single.evaluate(small + big_decode).p90_abs_pct_error > 8.0


def test_piecewise_fit_falls_back_to_one_fit_without_a_regime_or_enough_samples():
    train = grid_samples(0)
    assert CostModel.fit_piecewise(SHAPE, train, None).small_decode is None
    few_small = [s for s in train if not TRUTH.small_decode.applies(s.chunks)] + \
        [s for s in train if TRUTH.small_decode.applies(s.chunks)][:3]
    assert CostModel.fit_piecewise(SHAPE, few_small, 8).small_decode is None


def test_estimate_follows_the_regime_incrementally():
    """Adding requests one by one: predicted time always equals predict() of the step so far,
    the added times sum to it, for steps that enter, stay in and leave the small regime."""
    rng = np.random.default_rng(3)
    steps = [[ChunkShape(int(rng.integers(0, 3000)), 1) for _ in range(12)],
             [ChunkShape(100, 1)] * 5 + [ChunkShape(0, 64)] + [ChunkShape(200, 1)] * 3,
             [ChunkShape(0, 300), ChunkShape(700, 1)],
             [ChunkShape(900, 1)] * 8]
    for step in steps:
        est, total = TRUTH.new_estimate(), 0.0
        for i, c in enumerate(step):
            added = est.added_time_s(c.context_len, c.num_new_tokens)
            est.add(c.context_len, c.num_new_tokens)
            total += added
            assert est.predicted_time_s == pytest.approx(TRUTH.predict(step[:i + 1]), rel=1e-12)
            assert total == pytest.approx(est.predicted_time_s, rel=1e-12)
    # The 9th decode moves the step to the per-op cost: a jump, not one more stack row.
    est = TRUTH.new_estimate()
    for _ in range(8):
        est.add(1000, 1)
    ninth = est.added_time_s(1000, 1)
    assert ninth == pytest.approx(TRUTH.predict([ChunkShape(1000, 1)] * 9)
                                  - TRUTH.predict([ChunkShape(1000, 1)] * 8))
    assert ninth > 2 * (TRUTH.predict([ChunkShape(1000, 1)] * 8)
                        - TRUTH.predict([ChunkShape(1000, 1)] * 7))


@pytest.mark.parametrize("num_decodes", [0, 3, 8, 10])
def test_max_new_tokens_within_is_the_largest_chunk_that_fits(num_decodes):
    """Brute force over x: the answer is the largest x whose added time fits, also when the
    step is in the small regime (a chunk then pays leaving it; a decode may still fit)."""
    for context, limit_ms in itertools.product((0, 500, 2000), (0.5, 2, 5, 20, 80, 300)):
        est = TRUTH.new_estimate()
        for _ in range(num_decodes):
            est.add(700, 1)
        limit = limit_ms / 1e3
        got = est.max_new_tokens_within(context, 512, limit)
        fits = [x for x in range(1, 513) if est.added_time_s(context, x) <= limit]
        want = 0
        for x in range(1, 513):  # the largest prefix of fitting x (added time grows with x >= 2)
            if x in fits:
                want = x
            elif x >= 2:
                break
        assert got == want, (context, limit_ms, num_decodes)


def test_profile_v2_round_trip_keeps_the_regime_and_v1_still_loads():
    model = CostModel.fit_piecewise(SHAPE, grid_samples(0), 8, metadata={"grid": "x"})
    data = model.to_dict()
    assert data["format"] == "deepinfer.cost_profile.v2" and data["small_decode"]["max_rows"] == 8
    back = CostModel.from_dict(data)
    batches = [s.chunks for s in grid_samples(2)]
    assert [back.predict(b) for b in batches] == [model.predict(b) for b in batches]
    v1 = {k: v for k, v in data.items() if k != "small_decode"} | {"format": "deepinfer.cost_profile.v1"}
    old = CostModel.from_dict(v1)
    assert old.small_decode is None and old.coefficients == model.coefficients
    with pytest.raises(ValueError, match="small_decode"):
        CostModel.from_dict(data | {"small_decode": {"coefficients": {}}})
    # Applied to another model shape, the regime comes along.
    other = model.with_shape(SHAPE)
    assert other.small_decode is not None and other.predict(batches[0]) == model.predict(batches[0])


def test_regime_model_cannot_nest_and_needs_rows():
    with pytest.raises(ValueError):
        SmallDecodeRegime(0, CostModel(SHAPE, STACK_COEF))
    with pytest.raises(ValueError):
        SmallDecodeRegime(8, TRUTH)
