"""Default prefill cost for routing when no calibrated cost model is injected. Pure.

A router takes any `PrefillCostFn(num_uncached_tokens, num_cached_tokens) -> seconds`; the
calibrated one comes from `core.cost_model`. The default below has the shape of a transformer
prefill: linear layers cost per new token, attention of x new tokens after a cached prefix P
costs ~ x * (P + x/2), and a cached token costs a small load from the prefix store.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from deepinfer.core.cost_model import ChunkShape

PrefillCostFn = Callable[[int, int], float]


@dataclass(frozen=True)
class LinearQuadraticPrefillCost:
    """seconds = overhead + per_token*x + per_token_pair*x*(P + x/2) + per_cached_token*P,
    with x uncached (computed) tokens and P cached (loaded) tokens."""

    overhead_s: float = 2e-3
    per_token_s: float = 2e-4
    per_token_pair_s: float = 2e-9
    per_cached_token_s: float = 2e-6

    def __call__(self, num_uncached_tokens: int, num_cached_tokens: int) -> float:
        x, p = num_uncached_tokens, num_cached_tokens
        if x < 0 or p < 0:
            raise ValueError("token counts must be >= 0")
        if x == 0 and p == 0:
            return 0.0
        return (self.overhead_s + self.per_token_s * x + self.per_token_pair_s * x * (p + x / 2)
                + self.per_cached_token_s * p)


@dataclass(frozen=True)
class CostModelPrefillCost:
    """Prefill cost from a calibrated `core.cost_model.CostModel`: the predicted time of a step
    that computes the request's x uncached tokens after its P cached ones, plus a per-token
    load cost for the cached tokens (read from the prefix store, not computed)."""

    cost_model: object  # core.cost_model.CostModel (anything with predict(chunks) -> seconds)
    per_cached_token_s: float = 2e-6

    def __call__(self, num_uncached_tokens: int, num_cached_tokens: int) -> float:
        if num_uncached_tokens < 0 or num_cached_tokens < 0:
            raise ValueError("token counts must be >= 0")
        load_s = self.per_cached_token_s * num_cached_tokens
        if num_uncached_tokens == 0:
            return load_s
        step = [ChunkShape(context_len=num_cached_tokens, num_new_tokens=num_uncached_tokens)]
        return float(self.cost_model.predict(step)) + load_s
