"""`RestartPolicy`: how soon to restart a dead process, and when to give up. Pure.

One policy for every supervisor (the colocated engine, cluster workers, expert-parallel
groups): the k-th consecutive restart waits `initial_backoff_s · multiplier^(k-1)`, capped at
`max_backoff_s`; after `max_restarts` consecutive restarts the supervisor gives up; a process
that stayed up for `stable_after_s` starts over at k = 1, so one killed once a day is
restarted promptly forever while one that crashes at load is retried a bounded number of times.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RestartPolicy:
    """`max_restarts`: consecutive restarts before giving up (0: never restart).
    `ready_timeout_s`: how long a restarted process may take to become ready."""

    max_restarts: int = 5
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    multiplier: float = 2.0
    stable_after_s: float = 60.0
    ready_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.initial_backoff_s < 0 or self.max_backoff_s < self.initial_backoff_s:
            raise ValueError("need 0 <= initial_backoff_s <= max_backoff_s")
        if self.multiplier < 1:
            raise ValueError("back-off multiplier must be >= 1")
        if self.max_restarts < 0:
            raise ValueError("max_restarts must be >= 0")
        if self.stable_after_s < 0 or self.ready_timeout_s <= 0:
            raise ValueError("stable_after_s must be >= 0 and ready_timeout_s positive")

    def backoff_s(self, attempt: int) -> float:
        """Delay before the `attempt`-th consecutive restart (1-based)."""
        if attempt < 1:
            raise ValueError("attempt is 1-based")
        # min() before the power: a long-lived flapping process would overflow the float.
        exponent = min(attempt - 1, 64)
        return min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** exponent)
