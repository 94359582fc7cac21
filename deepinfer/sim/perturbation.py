"""Run-to-run noise for the simulator, stated as data: step-time noise and send lag. Pure.

The real engine is not deterministic: the same workload on the same cluster sees different
step times (other processes, caches, the OS), and the bench client sends each request a little
after its scheduled time. Where the schedule is sensitive to that timing (which prefill worker a
conversation turn lands on, whether a prompt makes the first step), one deterministic
simulation lands on one side of the real spread. A `NoiseSpec` perturbs a run; different seeds
give samples of it (`sim.sampling`). In a cluster file:

    noise: {step_time_cv: 0.04, arrival_jitter_ms: 2.0, seed: 0}

  step_time_cv       each simulated step's work × a lognormal factor with mean 1 and this
                     coefficient of variation; omitted: the profile's measured `step_time_cv`
                     (`deepinfer profile`, the spread of its repeated grid steps; 0 if none)
  arrival_jitter_ms  each request leaves this many ms late on average (exponential: a lag is
                     never negative); omitted: DEFAULT_ARRIVAL_JITTER_MS
  seed               the random streams (one per worker, one for arrivals) derive from it

Zero noise draws nothing and changes nothing: the run is bit-equal to an unperturbed one.
"""
from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

# The bench client's send lag when nothing measured it: asyncio wake-up and task start on an
# idle host are well under a millisecond; a stated, small default.
DEFAULT_ARRIVAL_JITTER_MS = 1.0


@dataclass(frozen=True)
class NoiseSpec:
    step_time_cv: float | None = None  # None: the profile's measured CV (0 when it has none)
    arrival_jitter_ms: float | None = None  # None: DEFAULT_ARRIVAL_JITTER_MS
    seed: int = 0

    def __post_init__(self) -> None:
        if self.step_time_cv is not None and not 0 <= self.step_time_cv < 1:
            raise ValueError("noise.step_time_cv must be in [0, 1)")
        if self.arrival_jitter_ms is not None and not self.arrival_jitter_ms >= 0:
            raise ValueError("noise.arrival_jitter_ms must be >= 0")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError("noise.seed must be an integer")

    def with_seed(self, seed: int) -> "NoiseSpec":
        return dataclasses.replace(self, seed=seed)

    def step_cv_for(self, profile_metadata: dict) -> float:
        """The CV this spec applies to steps of a pool whose profile has this metadata."""
        if self.step_time_cv is not None:
            return self.step_time_cv
        return float(profile_metadata.get("step_time_cv") or 0.0)

    @property
    def jitter_ms(self) -> float:
        return (DEFAULT_ARRIVAL_JITTER_MS if self.arrival_jitter_ms is None
                else self.arrival_jitter_ms)


class StepNoise:
    """Multiplicative step-time noise for one worker: lognormal, mean exactly 1, CV `cv`
    (lognormal: never negative, and a slow step is likelier than an equally fast one)."""

    def __init__(self, cv: float, seed: int, stream: str) -> None:
        self.cv = cv
        self._sigma = math.sqrt(math.log1p(cv * cv))
        self._rng = random.Random(f"{seed}:{stream}")  # str seeds are stable across runs

    def factor(self) -> float:
        if self.cv == 0.0:
            return 1.0
        return math.exp(self._rng.gauss(-0.5 * self._sigma ** 2, self._sigma))


def jitter_arrivals(requests: Sequence, jitter_ms: float, seed: int) -> list:
    """`requests` (BenchRequests) each sent an exponential lag of mean `jitter_ms` late;
    unchanged (the same objects) when the jitter is 0."""
    if jitter_ms == 0.0:
        return list(requests)
    rng = random.Random(f"{seed}:arrivals")
    mean_s = jitter_ms / 1e3
    return [dataclasses.replace(r, arrival_time_s=r.arrival_time_s + rng.expovariate(1 / mean_s))
            for r in requests]
