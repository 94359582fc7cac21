"""Time-budgeted steps: chunk sizes chosen so each step's predicted time fits a target. Pure.

The scheduler fills a step with running decodes first, then prefill chunks, asking the budget
`fit_chunk(context_len, num_tokens)` for each. Here:

* a decode (one new token) always fits — a step must serve its running decodes — and is charged;
  the scheduler asks for decodes before prefill chunks (a one-token request asked for after a
  prefill chunk is budgeted like any chunk); a decode with draft tokens to verify
  (`decode=True`) gets its own token the same way and as many drafts as the time left allows
  (no block alignment), and does not count as a prefill chunk;
* a prefill chunk gets the largest x whose added predicted time keeps the step within
  `step_time_budget_s` (the attention term makes that a quadratic in x; see
  `StepCostEstimate.max_new_tokens_within`), so x shrinks as the request's context P grows;
* x is cut so the chunk ends on a block boundary, unless it finishes the prompt;
* the first prefill chunk of a step gets at least `min_chunk_tokens` (or the rest of its prompt)
  even when the decodes already used the budget, so every request progresses: no starvation.
  Only then can a step's prediction exceed the budget: by decodes plus one minimum chunk.

The policy also calibrates itself online: `observe_step(predicted, measured)` (the scheduler
calls it after every step) keeps a slowly moving scale = measured / predicted, so when the
device runs slower or faster than when it was profiled (other processes, clocks, memory
bandwidth) chunks shrink or grow to keep the *measured* step time at the budget.
"""
from __future__ import annotations

import math

from deepinfer.core.cost_model import CostModel, StepCostEstimate


class ComputeAwareBudget:
    """One step's budget; see the module docstring for the rules."""

    def __init__(self, estimate: StepCostEstimate, step_time_budget_s: float, block_size: int,
                 min_chunk_tokens: int, max_num_batched_tokens: int | None,
                 time_scale: float = 1.0) -> None:
        self._estimate = estimate
        self.time_scale = time_scale  # measured / model-predicted, from online calibration
        self.step_time_budget_s = step_time_budget_s
        self._model_budget_s = step_time_budget_s / time_scale  # in the cost model's seconds
        self.block_size = block_size
        self.min_chunk_tokens = min_chunk_tokens
        self.remaining_tokens = max_num_batched_tokens  # None: no token cap
        self.num_prefill_chunks = 0

    @property
    def predicted_time_s(self) -> float:
        return self._estimate.predicted_time_s * self.time_scale

    def fit_chunk(self, context_len: int, num_tokens: int, *, decode: bool = False) -> int:
        if num_tokens <= 0:
            return 0
        if num_tokens == 1 and self.num_prefill_chunks == 0:
            return 1  # a decode, asked for before any prefill chunk: always served
        cap = num_tokens
        if self.remaining_tokens is not None:
            cap = min(cap, max(0, self.remaining_tokens))
        time_left = self._model_budget_s - self._estimate.predicted_time_s
        x = self._estimate.max_new_tokens_within(context_len, cap, time_left)
        if decode:  # verification: the decode's own token as above, then what fits
            return max(x, 1) if self.num_prefill_chunks == 0 else x
        x = self._align_end(context_len, x, num_tokens)
        if self.num_prefill_chunks == 0 and cap > 0:
            least = min(self.min_chunk_tokens, cap)
            x = max(x, self._align_end(context_len, least, num_tokens) or least)
        return x

    def consume(self, context_len: int, num_tokens: int, *, decode: bool = False) -> None:
        if num_tokens <= 0:
            return
        self._estimate.add(context_len, num_tokens)
        if num_tokens > 1 and not decode:
            self.num_prefill_chunks += 1
        if self.remaining_tokens is not None:
            self.remaining_tokens -= num_tokens

    def _align_end(self, context_len: int, x: int, num_tokens: int) -> int:
        """Cut x so the chunk ends on a block boundary, unless it completes the prompt."""
        if x >= num_tokens:
            return num_tokens
        end = (context_len + x) // self.block_size * self.block_size
        return max(0, end - context_len)


class ComputeAwarePolicy:
    """Makes a `ComputeAwareBudget` per step from one cost model and one time target."""

    name = "compute-aware"
    CALIBRATION_RATE = 0.05  # weight of one step in the running log-scale (~20-step memory)
    MAX_SCALE_STEP = 2.0  # one step moves the scale by at most this factor^rate (outliers)
    SCALE_LIMITS = (0.25, 4.0)

    def __init__(self, cost_model: CostModel, step_time_budget_s: float, *, block_size: int = 16,
                 min_chunk_tokens: int = 32, max_num_batched_tokens: int | None = None,
                 calibrate: bool = True) -> None:
        if not step_time_budget_s > 0:
            raise ValueError(f"step_time_budget_s must be positive, got {step_time_budget_s}")
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if min_chunk_tokens < 1:
            raise ValueError(f"min_chunk_tokens must be positive, got {min_chunk_tokens}")
        if max_num_batched_tokens is not None and max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be positive or None")
        self.cost_model = cost_model
        self.step_time_budget_s = float(step_time_budget_s)
        self.block_size = block_size
        self.min_chunk_tokens = min_chunk_tokens
        self.max_num_batched_tokens = max_num_batched_tokens
        self.calibrate = calibrate
        self.time_scale = 1.0

    def new_step(self) -> ComputeAwareBudget:
        return ComputeAwareBudget(self.cost_model.new_estimate(), self.step_time_budget_s,
                                  self.block_size, self.min_chunk_tokens,
                                  self.max_num_batched_tokens, self.time_scale)

    def observe_step(self, predicted_s: float, measured_s: float) -> None:
        """Feed back one step: `predicted_s` as this policy's budget reported it (already
        scaled), `measured_s` as the runner timed it. Moves `time_scale` towards their ratio."""
        if not self.calibrate or not (predicted_s > 0 and measured_s > 0):
            return
        ratio = min(max(measured_s / predicted_s, 1 / self.MAX_SCALE_STEP), self.MAX_SCALE_STEP)
        scale = self.time_scale * math.exp(self.CALIBRATION_RATE * math.log(ratio))
        self.time_scale = min(max(scale, self.SCALE_LIMITS[0]), self.SCALE_LIMITS[1])
