"""Per-step budgets the scheduler fills: by token count or by predicted compute time. Pure.

The scheduler asks a `StepBudgetPolicy` for a fresh `StepBudget` every step, then for each
request asks `fit_chunk(context_len, num_tokens)` (how many of the request's next tokens fit,
given `context_len` tokens already in its KV cache) and calls `consume` with what it took.
A decode with draft tokens to verify is asked for with `decode=True` (only then).
"""
from __future__ import annotations

from typing import Protocol


class StepBudget(Protocol):
    def fit_chunk(self, context_len: int, num_tokens: int, *, decode: bool = False) -> int:
        """Largest x <= num_tokens that still fits in this step (0 if none). `decode`: a
        decode's token followed by num_tokens - 1 draft tokens (speculative decoding)."""

    def consume(self, context_len: int, num_tokens: int, *, decode: bool = False) -> None:
        """Record that `num_tokens` new tokens after `context_len` were scheduled."""

    @property
    def predicted_time_s(self) -> float | None:
        """Predicted step time so far (None when the policy has no cost model)."""


class StepBudgetPolicy(Protocol):
    name: str

    def new_step(self) -> StepBudget: ...

    def observe_step(self, predicted_s: float, measured_s: float) -> None:
        """After a step with a prediction: the runner's measured time (for calibration)."""


class TokenBudget:
    """The classic budget: at most `max_num_batched_tokens` new tokens per step."""

    def __init__(self, max_num_batched_tokens: int) -> None:
        self.remaining = max_num_batched_tokens

    def fit_chunk(self, context_len: int, num_tokens: int, *, decode: bool = False) -> int:
        return max(0, min(num_tokens, self.remaining))

    def consume(self, context_len: int, num_tokens: int, *, decode: bool = False) -> None:
        self.remaining -= num_tokens

    @property
    def predicted_time_s(self) -> float | None:
        return None


class TokenBudgetPolicy:
    name = "token-budget"

    def __init__(self, max_num_batched_tokens: int) -> None:
        if max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be positive")
        self.max_num_batched_tokens = max_num_batched_tokens

    def new_step(self) -> TokenBudget:
        return TokenBudget(self.max_num_batched_tokens)

    def observe_step(self, predicted_s: float, measured_s: float) -> None:
        pass  # nothing to calibrate
