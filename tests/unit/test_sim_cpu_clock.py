"""A profile refitted on its steps' CPU seconds (the loaded-box check of simulated work)."""
from __future__ import annotations

import pytest

from deepinfer.core.cost_model import ChunkShape, CostModel, SmallDecodeRegime
from deepinfer.sim.step_time import refit_on_cpu_time
from tests.unit.test_cost_model_regimes import TRUTH, grid_samples
from tests.unit.test_cost_model import SHAPE


def profile_with_cpu(cpu_factor: float) -> CostModel:
    """A wall-time profile whose steps took `cpu_factor` x their wall time in CPU (< 1: the
    process waited for a core part of the time)."""
    samples = grid_samples(0)
    model = CostModel.fit_piecewise(SHAPE, samples, 8, metadata={"small_decode_rows": 8})
    model.metadata["samples"] = [
        {"chunks": [[c.context_len, c.num_new_tokens] for c in s.chunks],
         "step_time_s": s.step_time_s, "cpu_s": s.step_time_s * cpu_factor} for s in samples]
    return model


def test_refit_on_cpu_time_predicts_cpu_seconds_with_the_same_regimes():
    wall = profile_with_cpu(0.8)
    cpu = refit_on_cpu_time(wall)
    assert cpu.metadata["clock"] == "cpu" and cpu.small_decode is not None
    for step in ([ChunkShape(900, 1)] * 4, [ChunkShape(900, 1)] * 20,
                 [ChunkShape(0, 300), ChunkShape(100, 1)]):
        assert cpu.predict(step) == pytest.approx(0.8 * wall.predict(step), rel=0.03)
        assert cpu.predict(step) == pytest.approx(0.8 * TRUTH.predict(step), rel=0.05)


def test_refit_on_cpu_time_needs_cpu_times():
    wall = profile_with_cpu(1.0)
    for s in wall.metadata["samples"]:
        del s["cpu_s"]
    with pytest.raises(ValueError, match="CPU times"):
        refit_on_cpu_time(wall)
    with pytest.raises(ValueError):
        refit_on_cpu_time(CostModel(SHAPE, {}, small_decode=SmallDecodeRegime(8, CostModel(SHAPE, {}))))
