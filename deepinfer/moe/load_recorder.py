"""Sliding window of expert load for the load balancer. PURE: numpy only.

Each step a rank records how many (token, expert) pairs its tokens sent to every physical slot
of every MoE layer. The window keeps the last `window_size` steps in a ring, both per physical
slot (what the ranks actually carried) and per logical expert (what the planner needs; converted
with the map in force at that step, so a rebalance does not scramble the history).
"""
from __future__ import annotations

import numpy as np


class ExpertLoadRecorder:
    def __init__(self, num_layers: int, num_logical: int, num_physical: int, window_size: int) -> None:
        if window_size < 1:
            raise ValueError("window_size must be >= 1")
        self.num_logical = num_logical
        self.window_size = window_size
        self._slot = np.zeros((window_size, num_layers, num_physical), dtype=np.int64)
        self._logical = np.zeros((window_size, num_layers, num_logical), dtype=np.int64)
        self.num_steps = 0  # steps recorded so far (the ring index is num_steps % window_size)

    def record(self, slot_loads: np.ndarray, phy2log: np.ndarray) -> None:
        """slot_loads [layers, num_physical] pairs this step; phy2log [layers, num_physical]."""
        slot_loads = np.asarray(slot_loads, dtype=np.int64)
        if slot_loads.shape != self._slot.shape[1:]:
            raise ValueError(f"slot loads of shape {slot_loads.shape}, expected {self._slot.shape[1:]}")
        i = self.num_steps % self.window_size
        self._slot[i] = slot_loads
        for layer in range(slot_loads.shape[0]):
            self._logical[i, layer] = np.bincount(phy2log[layer], weights=slot_loads[layer],
                                                  minlength=self.num_logical).astype(np.int64)
        self.num_steps += 1

    def logical_loads(self) -> np.ndarray:
        """[layers, num_logical] pairs per logical expert over the window."""
        return self._logical.sum(0)

    def slot_loads(self) -> np.ndarray:
        """[layers, num_physical] pairs per physical slot over the window."""
        return self._slot.sum(0)

    def reset(self) -> None:
        self._slot[:] = 0
        self._logical[:] = 0
        self.num_steps = 0
