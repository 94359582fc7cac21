"""ExpertLoadRecorder: a sliding window of the last `window_size` steps, per slot and per
logical expert, converted with the slot map in force at each step."""
from __future__ import annotations

import numpy as np
import pytest

from deepinfer.moe.load_recorder import ExpertLoadRecorder


def test_window_keeps_only_the_last_steps_and_converts_with_each_steps_map():
    rec = ExpertLoadRecorder(num_layers=1, num_logical=2, num_physical=3, window_size=2)
    map_a = np.array([[0, 1, 0]])  # expert 0 on slots 0 and 2
    map_b = np.array([[1, 1, 0]])  # after a rebalance: expert 1 replicated
    rec.record(np.array([[5, 1, 5]]), map_a)  # falls out of the window below
    rec.record(np.array([[1, 2, 3]]), map_a)
    rec.record(np.array([[4, 4, 1]]), map_b)
    assert rec.slot_loads().tolist() == [[5, 6, 4]]
    assert rec.logical_loads().tolist() == [[1 + 3 + 1, 2 + 8]]
    assert rec.num_steps == 3
    rec.reset()
    assert rec.logical_loads().sum() == 0


def test_bad_shapes_and_window_are_errors():
    with pytest.raises(ValueError):
        ExpertLoadRecorder(1, 2, 2, window_size=0)
    rec = ExpertLoadRecorder(1, 2, 2, window_size=3)
    with pytest.raises(ValueError):
        rec.record(np.zeros((2, 2)), np.zeros((2, 2), dtype=int))
