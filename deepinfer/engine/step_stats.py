"""Counters of an engine's steps and of how well the scheduler predicted their time."""
from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass
class StepStats:
    """Field names are EngineStats' (the engine's stats take them as they are)."""
    num_steps: int = 0
    step_time_s: float = 0.0  # the last step's measured time
    predicted_step_time_s: float | None = None  # the last step's prediction, if any
    prediction_abs_error_sum: float = 0.0  # sum of |predicted - measured| / measured
    num_predicted_steps: int = 0

    def record(self, predicted_s: float | None, measured_s: float) -> None:
        self.num_steps += 1
        self.step_time_s = measured_s
        self.predicted_step_time_s = predicted_s
        if predicted_s is not None and measured_s > 0:
            self.prediction_abs_error_sum += abs(predicted_s - measured_s) / measured_s
            self.num_predicted_steps += 1
            logger.debug("step %d: predicted %.2f ms, measured %.2f ms", self.num_steps,
                         predicted_s * 1e3, measured_s * 1e3)
