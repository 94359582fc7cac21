"""Statistics of repeated step timings, kept in the core: the profiler computes them when it
fits a cost model and the simulator reads them back as its step-time noise."""
from __future__ import annotations

import math
from collections.abc import Sequence


def repeat_cv(repeats: Sequence[Sequence[float]]) -> float | None:
    """Pooled coefficient of variation of repeated timings of the same steps (one list per
    step, each timed >= 2 times): sqrt(sum of squared deviations from each step's mean /
    sum of (n - 1) · mean²). Weighted by step time² on purpose: the long steps, whose timing
    moves the schedule, set it, not the timer jitter of millisecond steps. None when no step
    was timed twice."""
    num = den = 0.0
    for times in repeats:
        if len(times) < 2:
            continue
        mean = sum(times) / len(times)
        num += sum((t - mean) ** 2 for t in times)
        den += (len(times) - 1) * mean * mean
    return math.sqrt(num / den) if den > 0 else None
