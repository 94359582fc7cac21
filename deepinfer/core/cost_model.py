"""Predicted step time from the shape of a batch. Pure: stdlib + numpy.

A step runs, for each scheduled request, `x` new tokens after a context of `P` tokens already in
its KV cache. Its time is modelled as a non-negative combination of six features:

    linear_flops         2 · active_params · Σ x              (projections, MLP / experts)
    attention_flops      4 · L · H · d · Σ x · (P + x/2)       (causal QK^T and PV)
    bytes_moved          weight_bytes_read(Σ x) + kv_bytes_per_token · Σ (P + x)
    decode_kv_bytes      kv_bytes_per_token · Σ over decodes of (P + 1)
    num_requests         number of requests in the step       (per-request overhead, LM head)
    step                 1                                     (launch / framework overhead)

For a dense model `weight_bytes_read` is all the weights; for an MoE model it is the dense part
plus the routed experts the step's Σ x tokens are expected to touch (`ModelShape`), so big
batches read more expert weights than small ones. (`linear_flops` already uses the *active*
parameters: dense part + top-k routed + shared experts.)

`decode_kv_bytes` is the extra cost of decode attention per KV byte: a decode reads its whole
context for a single query (no reuse, its own kernel), while a prefill chunk amortises the read
over x queries. Without it, held-out error on this CPU roughly triples (decode steps at long
context are underpredicted). A decode is a request with x == 1.

Coefficients are seconds per feature unit, fitted on measured steps (a *profile*) by
non-negative least squares on relative error, so short decode steps count as much as long
prefills. `StepCostEstimate` is the incremental form the scheduler's budget uses: O(1) per
added request, plus the largest chunk that fits in a time limit (a quadratic in x).

Piecewise where the engine is: a profile may carry a second coefficient set for *small decode*
steps (only decodes, at most `max_rows` of them). The CPU engine runs those through a fused C
decode stack (runtime/cpu_decode_stack.py, ~1.5x cheaper per token than the per-op path that
larger decode steps, prefills and mixed steps take), so one linear fit through both regimes
over-predicts one and under-predicts the other. Profile format v2 stores that regime; v1
profiles (one regime) still load.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from deepinfer.core.least_squares import nonnegative_least_squares
from deepinfer.core.model_shape import ModelShape

FEATURE_NAMES = ("linear_flops", "attention_flops", "bytes_moved", "decode_kv_bytes",
                 "num_requests", "step")
PROFILE_FORMAT = "deepinfer.cost_profile.v2"
PROFILE_FORMATS = ("deepinfer.cost_profile.v1", PROFILE_FORMAT)  # readable
MIN_REGIME_SAMPLES = 4  # fewer measured small-decode steps: one fit for all steps


@dataclass(frozen=True)
class ChunkShape:
    """One request's work in one step: `num_new_tokens` after `context_len` cached tokens."""

    context_len: int
    num_new_tokens: int

    def __post_init__(self) -> None:
        if self.context_len < 0 or self.num_new_tokens < 1:
            raise ValueError(f"bad chunk: context_len={self.context_len}, "
                             f"num_new_tokens={self.num_new_tokens}")


@dataclass(frozen=True)
class StepSample:
    """A measured step: the batch and how long it took."""

    chunks: tuple[ChunkShape, ...]
    step_time_s: float


@dataclass(frozen=True)
class PredictionError:
    """Absolute percent error |predicted - measured| / measured · 100 over some steps."""

    median_abs_pct_error: float
    p90_abs_pct_error: float
    num_samples: int


@dataclass(frozen=True)
class SmallDecodeRegime:
    """Steps of only decodes, at most `max_rows` of them, cost by their own `model` (one
    regime, no nested regimes)."""

    max_rows: int
    model: "CostModel"

    def __post_init__(self) -> None:
        if self.max_rows < 1:
            raise ValueError(f"small-decode regime needs max_rows >= 1, got {self.max_rows}")
        if self.model.small_decode is not None:
            raise ValueError("a regime's model cannot have regimes itself")

    def applies(self, chunks: Sequence[ChunkShape]) -> bool:
        return 0 < len(chunks) <= self.max_rows and all(c.num_new_tokens == 1 for c in chunks)


class CostModel:
    """Step time = Σ coefficient[f] · feature[f]; coefficients are >= 0 seconds per unit.
    With `small_decode`, steps it applies to use its coefficients instead."""

    def __init__(self, shape: ModelShape, coefficients: dict[str, float], *,
                 metadata: dict[str, Any] | None = None,
                 holdout_error: PredictionError | None = None,
                 small_decode: SmallDecodeRegime | None = None) -> None:
        unknown = set(coefficients) - set(FEATURE_NAMES)
        if unknown:
            raise ValueError(f"unknown cost features: {sorted(unknown)}")
        coef = {name: float(coefficients.get(name, 0.0)) for name in FEATURE_NAMES}
        if any(not math.isfinite(v) or v < 0 for v in coef.values()):
            raise ValueError(f"cost coefficients must be finite and >= 0: {coef}")
        self.shape = shape
        self.coefficients = coef
        self.metadata = dict(metadata or {})
        self.holdout_error = holdout_error
        self.small_decode = small_decode
        # Seconds per unit of the per-request sums StepCostEstimate keeps.
        self.s_per_token = coef["linear_flops"] * 2 * shape.active_params
        self.s_per_attn_pair = coef["attention_flops"] * shape.attention_flops_per_pair
        self.s_per_kv_token = coef["bytes_moved"] * shape.kv_bytes_per_token
        self.s_per_decode_kv_token = coef["decode_kv_bytes"] * shape.kv_bytes_per_token
        self.s_per_request = coef["num_requests"]
        self.s_per_step = coef["step"] + coef["bytes_moved"] * shape.dense_weight_bytes
        self.s_per_expert_byte = coef["bytes_moved"] * shape.expert_bytes  # x distinct experts

    # -- prediction ------------------------------------------------------------------------
    def features(self, chunks: Sequence[ChunkShape]) -> np.ndarray:
        """Feature vector (in FEATURE_NAMES order) of one step; zeros for an empty step."""
        if not chunks:
            return np.zeros(len(FEATURE_NAMES))
        s = self.shape
        sum_x = sum(c.num_new_tokens for c in chunks)
        pairs = sum(c.num_new_tokens * (c.context_len + c.num_new_tokens / 2) for c in chunks)
        kv_tokens = sum(c.context_len + c.num_new_tokens for c in chunks)
        decode_kv_tokens = sum(c.context_len + 1 for c in chunks if c.num_new_tokens == 1)
        kvb = float(s.kv_bytes_per_token)
        return np.array([2.0 * s.active_params * sum_x, float(s.attention_flops_per_pair) * pairs,
                         s.weight_bytes_read(sum_x) + kvb * kv_tokens, kvb * decode_kv_tokens,
                         float(len(chunks)), 1.0])

    def predict(self, chunks: Sequence[ChunkShape]) -> float:
        """Predicted seconds for a step running `chunks` (0.0 for an empty step)."""
        estimate = self.new_estimate()
        for c in chunks:
            estimate.add(c.context_len, c.num_new_tokens)
        return estimate.predicted_time_s

    def new_estimate(self) -> "StepCostEstimate":
        return StepCostEstimate(self)

    def evaluate(self, samples: Iterable[StepSample]) -> PredictionError:
        return prediction_error([self.predict(s.chunks) for s in samples],
                                [s.step_time_s for s in samples])

    # -- fitting ---------------------------------------------------------------------------
    @classmethod
    def fit(cls, shape: ModelShape, samples: Sequence[StepSample], *,
            metadata: dict[str, Any] | None = None) -> "CostModel":
        """Least-squares fit of the coefficients (>= 0) minimising squared *relative* error."""
        samples = [s for s in samples if s.chunks]
        if len(samples) < len(FEATURE_NAMES):
            raise ValueError(f"need at least {len(FEATURE_NAMES)} non-empty samples, "
                             f"got {len(samples)}")
        if any(not s.step_time_s > 0 for s in samples):
            raise ValueError("measured step times must be positive")
        return cls.fit_nonempty(shape, samples, metadata=metadata)

    @classmethod
    def fit_piecewise(cls, shape: ModelShape, samples: Sequence[StepSample],
                      small_decode_max_rows: int | None, *,
                      metadata: dict[str, Any] | None = None) -> "CostModel":
        """`fit` per regime: decode-only steps of <= `small_decode_max_rows` rows get their own
        coefficients, every other step the main ones. One fit for all steps when
        `small_decode_max_rows` is None or either side has too few samples to fit."""
        if small_decode_max_rows is None:
            return cls.fit(shape, samples, metadata=metadata)
        probe = SmallDecodeRegime(small_decode_max_rows, cls(shape, {}))
        small = [s for s in samples if probe.applies(s.chunks)]
        rest = [s for s in samples if s.chunks and not probe.applies(s.chunks)]
        if len(small) < MIN_REGIME_SAMPLES or len(rest) < len(FEATURE_NAMES):
            return cls.fit(shape, samples, metadata=metadata)
        main = cls.fit(shape, rest, metadata=metadata)
        main.small_decode = SmallDecodeRegime(small_decode_max_rows,
                                              cls.fit_nonempty(shape, small))
        return main

    @classmethod
    def fit_nonempty(cls, shape: ModelShape, samples: Sequence[StepSample], *,
                     metadata: dict[str, Any] | None = None) -> "CostModel":
        """`fit` without the minimum sample count: for a regime whose steps vary in fewer
        features than FEATURE_NAMES (decodes only), where NNLS still gives one solution's
        predictions."""
        times = np.array([s.step_time_s for s in samples])
        if not len(samples) or (times <= 0).any():
            raise ValueError("need some samples with positive step times")
        probe = cls(shape, {})
        rows = np.stack([probe.features(s.chunks) for s in samples]) / times[:, None]
        x = nonnegative_least_squares(rows, np.ones(len(samples)))
        return cls(shape, dict(zip(FEATURE_NAMES, x.tolist())), metadata=metadata)

    # -- profile (de)serialisation -----------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "format": PROFILE_FORMAT,
            "model_shape": self.shape.to_dict(),
            "coefficients": dict(self.coefficients),
            "metadata": dict(self.metadata),
        }
        if self.small_decode is not None:
            data["small_decode"] = {"max_rows": self.small_decode.max_rows,
                                    "coefficients": dict(self.small_decode.model.coefficients)}
        if self.holdout_error is not None:
            data["holdout_median_abs_pct_error"] = self.holdout_error.median_abs_pct_error
            data["holdout_p90_abs_pct_error"] = self.holdout_error.p90_abs_pct_error
            data["holdout_num_samples"] = self.holdout_error.num_samples
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CostModel":
        if not isinstance(data, dict) or data.get("format") not in PROFILE_FORMATS:
            raise ValueError(f"not a cost profile (expected format {PROFILE_FORMAT!r})")
        holdout = None
        if "holdout_median_abs_pct_error" in data:
            holdout = PredictionError(float(data["holdout_median_abs_pct_error"]),
                                      float(data["holdout_p90_abs_pct_error"]),
                                      int(data.get("holdout_num_samples", 0)))
        shape = ModelShape.from_dict(data.get("model_shape", {}))
        small = data.get("small_decode")
        regime = None
        if small is not None:
            if not isinstance(small, dict) or "max_rows" not in small:
                raise ValueError("bad small_decode regime in cost profile")
            regime = SmallDecodeRegime(int(small["max_rows"]),
                                       cls(shape, dict(small.get("coefficients", {}))))
        return cls(shape, dict(data.get("coefficients", {})), metadata=data.get("metadata"),
                   holdout_error=holdout, small_decode=regime)

    def with_shape(self, shape: ModelShape) -> "CostModel":
        """The same coefficients (and regime) applied to another model shape."""
        regime = self.small_decode
        if regime is not None:
            regime = SmallDecodeRegime(regime.max_rows, CostModel(shape, regime.model.coefficients))
        return CostModel(shape, self.coefficients, metadata=self.metadata,
                         holdout_error=self.holdout_error, small_decode=regime)


@dataclass
class StepCostEstimate:
    """Running sums of one step being built; every method is O(1).

    With a small-decode regime both regimes' sums are kept while the step could still be a
    small decode step; `predicted_time_s` is the one of the regime the step is in now, and
    `added_time_s` the change in it (a chunk that moves the step out of the regime is charged
    the difference between the regimes' totals)."""

    model: CostModel
    num_requests: int = 0
    predicted_time_s: float = field(default=0.0)
    num_tokens: int = 0
    _main_s: float = field(default=0.0, repr=False)  # the main coefficients' total
    _small: "StepCostEstimate | None" = field(default=None, repr=False)

    def __post_init__(self) -> None:
        regime = self.model.small_decode
        if regime is not None and self.num_requests == 0:
            self._small = StepCostEstimate(regime.model)

    def _stays_small(self, num_new_tokens: int) -> bool:
        regime = self.model.small_decode
        return (self._small is not None and num_new_tokens == 1
                and self.num_requests + 1 <= regime.max_rows)

    def added_time_s(self, context_len: int, num_new_tokens: int) -> float:
        """Seconds that adding this request's chunk would add to the step (0 for no tokens)."""
        if num_new_tokens <= 0:
            return 0.0
        if self._stays_small(num_new_tokens):
            return self._small.added_time_s(context_len, num_new_tokens)
        return (self._main_s - self.predicted_time_s
                + self._main_added_time_s(context_len, num_new_tokens))

    def _main_added_time_s(self, context_len: int, num_new_tokens: int) -> float:
        a, b, c = self._quadratic(context_len)
        x = float(num_new_tokens)
        added = (a * x + b) * x + c
        if num_new_tokens == 1:  # decode attention reads the whole context for one query
            added += self.model.s_per_decode_kv_token * (context_len + 1)
        return added + self._expert_read_time_s(num_new_tokens)

    def _expert_read_time_s(self, num_new_tokens: int) -> float:
        """MoE: time to read the experts these tokens touch that the step's earlier tokens did not."""
        m = self.model
        if not m.s_per_expert_byte:
            return 0.0
        distinct = m.shape.expected_distinct_experts
        return m.s_per_expert_byte * (distinct(self.num_tokens + num_new_tokens) - distinct(self.num_tokens))

    def add(self, context_len: int, num_new_tokens: int) -> None:
        if num_new_tokens <= 0:
            return
        if self._stays_small(num_new_tokens):
            self._small.add(context_len, num_new_tokens)
        else:
            self._small = None  # the step left the small-decode regime for good
        self._main_s += self._main_added_time_s(context_len, num_new_tokens)
        self.predicted_time_s = (self._small.predicted_time_s if self._small is not None
                                 else self._main_s)
        self.num_requests += 1
        self.num_tokens += num_new_tokens

    def max_new_tokens_within(self, context_len: int, max_tokens: int, time_left_s: float
                              ) -> int:
        """Largest x in [0, max_tokens] with added_time_s(context_len, x) <= time_left_s
        (for x >= 2, a prefill chunk; the answer 1 is checked against the decode cost)."""
        if max_tokens <= 0:
            return 0
        a, b, c = self._quadratic(context_len)
        # A chunk of x >= 2 runs in the main regime: it also pays leaving the small one.
        room = time_left_s - c - (self._main_s - self.predicted_time_s)
        if room < 0:
            n = 0
        elif a > 0:  # a x^2 + b x - room = 0, the stable form of the positive root
            x = 2.0 * room / (b + math.sqrt(b * b + 4.0 * a * room)) if room > 0 else 0.0
            n = int(min(float(max_tokens), math.floor(x)))
        elif b > 0:
            n = int(min(float(max_tokens), math.floor(room / b)))
        else:
            n = max_tokens
        if self.model.s_per_expert_byte and n > 2:
            # The concave expert-read term is not in the quadratic, so n over-estimates: find
            # the largest prefill chunk (added time increases with x for x >= 2) by bisection.
            lo, hi = 2, n
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if self.added_time_s(context_len, mid) <= time_left_s else (lo, mid - 1)
            n = lo
        # Guard the float solve: step down / up by one where rounding put us off the root.
        while n > 0 and self.added_time_s(context_len, n) > time_left_s:
            n -= 1
        if n == 0 and self.added_time_s(context_len, 1) <= time_left_s:
            n = 1  # a decode may fit in the small regime where no chunk fits in the main one
        while n < max_tokens and self.added_time_s(context_len, n + 1) <= time_left_s:
            n += 1
        return n

    def _quadratic(self, context_len: int) -> tuple[float, float, float]:
        """(a, b, c) with main-regime added time a x^2 + b x + c for x new tokens after
        context_len."""
        m = self.model
        p = float(context_len)
        a = m.s_per_attn_pair / 2.0
        b = m.s_per_token + m.s_per_attn_pair * p + m.s_per_kv_token
        c = m.s_per_request + m.s_per_kv_token * p
        if self.num_requests == 0:  # the first request brings the step's fixed cost
            c += m.s_per_step
        return a, b, c


def prediction_error(predicted: Sequence[float], measured: Sequence[float]) -> PredictionError:
    """Median and p90 of |predicted - measured| / measured, in percent."""
    if len(predicted) != len(measured) or not measured:
        raise ValueError("need equally many (and some) predicted and measured times")
    pred = np.asarray(predicted, dtype=np.float64)
    meas = np.asarray(measured, dtype=np.float64)
    if (meas <= 0).any():
        raise ValueError("measured times must be positive")
    pct = np.abs(pred - meas) / meas * 100.0
    return PredictionError(float(np.median(pct)), float(np.percentile(pct, 90)), len(pct))


# --- load or recompute ------------------------------------------------------------------------
# A prefix found in a lower tier (host memory, fs, Redis) can be loaded into device blocks or
# recomputed. Loading k blocks costs a round trip plus their bytes at the tier's measured
# bandwidth; recomputing costs prefill compute. `plan_store_load` takes the cheaper, so a slow
# store never makes a prefill slower than having no store.


@dataclass
class RateEstimator:
    """Seconds per unit (byte, token) as an exponentially weighted mean of measurements,
    starting from `prior_s_per_unit`; `latency_s` per operation is added by `seconds`.

    Measurements are weighted by their size (`units`), so one tiny read cannot swing it."""

    prior_s_per_unit: float
    latency_s: float = 0.0
    weight: float = 0.2  # share of the estimate a measurement of `typical_units` replaces
    typical_units: float = 1.0
    s_per_unit: float = field(init=False)
    num_samples: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.prior_s_per_unit < 0 or self.latency_s < 0 or not 0 < self.weight <= 1 \
                or self.typical_units <= 0:
            raise ValueError("rate prior and latency must be >= 0, weight in (0, 1], "
                             "typical_units > 0")
        self.s_per_unit = self.prior_s_per_unit

    def observe(self, units: float, seconds: float) -> None:
        """One measurement: `units` took `seconds` (the per-operation latency included)."""
        if units <= 0 or seconds < 0:
            return
        rate = max(0.0, seconds - self.latency_s) / units
        w = min(1.0, self.weight * units / self.typical_units)
        if self.num_samples == 0:
            w = max(w, 0.5)  # the first real measurement beats a guessed prior
        self.s_per_unit += w * (rate - self.s_per_unit)
        self.num_samples += 1

    def seconds(self, units: float) -> float:
        return 0.0 if units <= 0 else self.latency_s + self.s_per_unit * units


PREFILL_COMPUTE_PRIOR_S_PER_TOKEN = 1e-3  # until a prefill worker has measured itself


def prefill_compute_rate() -> RateEstimator:
    """A prefill worker's measured compute rate (wall seconds per computed token), as it
    reports it in `WorkerLoad.compute_s_per_token`; the engine's workers and the simulator's
    keep the same estimator so the router gets the same input from both."""
    return RateEstimator(PREFILL_COMPUTE_PRIOR_S_PER_TOKEN, typical_units=256)


@dataclass(frozen=True)
class StoreLoadPlan:
    """How many leading store blocks to load (the rest is recomputed), and the predicted
    seconds of both parts."""

    num_load_blocks: int
    load_s: float
    compute_s: float

    @property
    def total_s(self) -> float:
        return self.load_s + self.compute_s


def plan_store_load(num_prompt_tokens: int, num_device_tokens: int, num_store_blocks: int,
                    block_size: int, load_s: Callable[[int], float],
                    compute_s: Callable[[int, int], float]) -> StoreLoadPlan:
    """The number k of the `num_store_blocks` blocks after the device-cached head worth
    loading: argmin over k of `load_s(k)` + `compute_s(rest, context)`, where the rest of the
    prompt (`num_prompt_tokens - num_device_tokens - k * block_size` tokens) is computed after
    a context of `num_device_tokens + k * block_size`. Ties go to fewer loaded blocks.

    `load_s(k)`: seconds to read k blocks (0 for k = 0); `compute_s(new, context)`: seconds to
    prefill `new` tokens after `context` cached ones (a `routing.PrefillCostFn`)."""
    if min(num_prompt_tokens, num_device_tokens, num_store_blocks) < 0 or block_size < 1:
        raise ValueError("token and block counts must be >= 0, block_size >= 1")
    max_blocks = max(0, min(num_store_blocks,
                            (num_prompt_tokens - num_device_tokens) // block_size))
    best: StoreLoadPlan | None = None
    for k in range(max_blocks + 1):
        context = num_device_tokens + k * block_size
        plan = StoreLoadPlan(k, load_s(k) if k else 0.0,
                             compute_s(num_prompt_tokens - context, context))
        if best is None or plan.total_s < best.total_s:
            best = plan
    return best
