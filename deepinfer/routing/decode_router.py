"""Decode routing policies. Pure.

A decode worker's pressure is two-dimensional: the number of running requests (batch size,
step time) and the accumulated KV length (memory, attention time). The default `balanced`
policy scores both, in the way DeepSeek balances KV usage and request count per rank:

    score = running_weight * (active + reserved_reqs) / max_running_reqs
          + kv_weight      * (kv_tokens + reserved_kv_tokens + request_kv) / kv_capacity_tokens

where active = running + waiting and reserved_* are the requests routed to the worker since
its last load report (`ReservationLedger`); request_kv = prompt + expected output tokens.

High-water mark: a worker is skipped when (kv_tokens + reserved_kv_tokens + prompt tokens of
this request) / kv_capacity exceeds `kv_high_watermark` (the prompt's KV is allocated for
certain at handoff; the expected output is a guess and only counts in the score). If every
worker is over the mark, `overload_policy` decides: "least-loaded" (default) picks the lowest
score anyway, leaving the decode worker's scheduler to queue or preempt; "raise" raises
`NoWorkerAvailable` so the caller can hold the request back (backpressure).

Whole-cache fit: a worker whose entire KV cache cannot hold the prompt plus the first sampled
token is never picked for it; when no worker can, `RequestTooLarge` (a ValueError) says so at
once (`check_fits` lets the front refuse before spending a prefill on it).

Alternatives for comparison: `round-robin`, `least-requests`, `least-kv` (high-water mark off
unless given). Workers with role "decode" or "colocated" and a known KV capacity (> 0 blocks)
are routable.
"""
from __future__ import annotations

from collections.abc import Sequence

from deepinfer.routing.router_base import (NoWorkerAvailable, RequestTooLarge, Router,
                                           build_router, next_round_robin)
from deepinfer.routing.routing_request import RoutingRequest
from deepinfer.routing.worker_load import WorkerLoad

OVERLOAD_POLICIES = ("least-loaded", "raise")
SCORINGS = ("relative-max", "linear")


class DecodeRouter(Router):
    accepted_roles = ("decode", "colocated")

    def __init__(self, kv_high_watermark: float | None = None,
                 overload_policy: str = "least-loaded", report_lag_s: float = 0.0) -> None:
        super().__init__(report_lag_s)
        if kv_high_watermark is not None and not 0.0 < kv_high_watermark <= 1.0:
            raise ValueError(f"kv_high_watermark must be in (0, 1], got {kv_high_watermark}")
        if overload_policy not in OVERLOAD_POLICIES:
            raise ValueError(f"overload_policy must be one of {OVERLOAD_POLICIES}, "
                             f"got {overload_policy!r}")
        self.kv_high_watermark = kv_high_watermark
        self.overload_policy = overload_policy
        self.num_overloaded = 0  # decisions taken with every worker over the mark (a metric)

    def _is_routable(self, load: WorkerLoad) -> bool:
        return load.kv_capacity_tokens > 0

    # --- load views, reservations included -------------------------------------------------
    def num_reqs(self, load: WorkerLoad) -> int:
        return load.num_active_reqs + self.reserved(load.worker_id).num_reqs

    def kv_tokens(self, load: WorkerLoad) -> int:
        return load.kv_tokens + self.reserved(load.worker_id).num_kv_tokens

    def kv_usage(self, load: WorkerLoad, extra_tokens: int = 0) -> float:
        return (self.kv_tokens(load) + extra_tokens) / load.kv_capacity_tokens

    # --- whole-cache fit -------------------------------------------------------------------
    @staticmethod
    def min_kv_tokens(request: RoutingRequest) -> int:
        """KV a worker must hold at admission: the prompt and the first sampled token."""
        return request.num_prompt_tokens + 1

    def fitting(self, request: RoutingRequest, candidates: list[WorkerLoad]) -> list[WorkerLoad]:
        """Candidates whose whole KV cache can hold the request; RequestTooLarge if none."""
        need = self.min_kv_tokens(request)
        fits = [ld for ld in candidates if ld.kv_capacity_tokens >= need]
        if not fits:
            largest = max(ld.kv_capacity_tokens for ld in candidates)
            raise RequestTooLarge(
                f"the prompt has {request.num_prompt_tokens} tokens, but the largest decode "
                f"worker's whole KV cache holds {largest} tokens (prompt + 1 needed)")
        return fits

    def check_fits(self, request: RoutingRequest, loads: Sequence[WorkerLoad]) -> None:
        """Raise RequestTooLarge (or NoWorkerAvailable) now if `request` could never be routed."""
        self.fitting(request, self.candidates(loads))

    def select(self, request: RoutingRequest, loads: Sequence[WorkerLoad], now: float) -> str:
        return self._choose(request, self.fitting(request, self.candidates(loads)), now)

    # --- policy ----------------------------------------------------------------------------
    def _rank(self, request: RoutingRequest, load: WorkerLoad) -> tuple:
        """Sort key of a worker for this request; lowest wins."""
        raise NotImplementedError

    def eligible(self, request: RoutingRequest, candidates: list[WorkerLoad]) -> list[WorkerLoad]:
        """Candidates under the KV high-water mark, or per `overload_policy` if none is."""
        if self.kv_high_watermark is None:
            return candidates
        under = [ld for ld in candidates
                 if self.kv_usage(ld, request.num_prompt_tokens) <= self.kv_high_watermark]
        if under:
            return under
        if self.overload_policy == "raise":
            raise NoWorkerAvailable(
                f"{self.name}: all {len(candidates)} decode workers are above the KV "
                f"high-water mark {self.kv_high_watermark:.2f}")
        self.num_overloaded += 1
        return candidates

    def _choose(self, request: RoutingRequest, candidates: list[WorkerLoad], now: float) -> str:
        pool = self.eligible(request, candidates)
        return min(pool, key=lambda ld: self._rank(request, ld)).worker_id


class BalancedDecodeRouter(DecodeRouter):
    """Balances running requests and KV tokens together (see the module docstring).

    scoring="relative-max" (default): each term is divided by the fleet's mean of that term
    (after placing this request), and a worker's score is the larger of the two, so the
    request goes where it raises the worse of the two imbalances (max/mean) least; the linear
    score breaks ties. scoring="linear": the plain weighted sum above. The linear sum lets the
    term with the larger scale dominate (e.g. 10 running of 256 slots vs 50% KV), which left
    the running count less balanced than round-robin in the router tests; relative-max keeps
    both max/mean ratios low whatever the scales.
    """

    name = "balanced"

    def __init__(self, running_weight: float = 1.0, kv_weight: float = 1.0,
                 scoring: str = "relative-max", kv_high_watermark: float | None = 0.9,
                 overload_policy: str = "least-loaded", report_lag_s: float = 0.0) -> None:
        super().__init__(kv_high_watermark, overload_policy, report_lag_s)
        if running_weight < 0 or kv_weight < 0 or running_weight + kv_weight == 0:
            raise ValueError("weights must be >= 0 and not both 0")
        if scoring not in SCORINGS:
            raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
        self.running_weight = running_weight
        self.kv_weight = kv_weight
        self.scoring = scoring

    def utilization(self, request: RoutingRequest, load: WorkerLoad) -> tuple[float, float]:
        """(request-slot use, KV use) of `load`'s worker if `request` went there."""
        return ((self.num_reqs(load) + 1) / load.max_running_reqs,
                self.kv_usage(load, request.num_reserved_kv_tokens))

    def score(self, request: RoutingRequest, load: WorkerLoad) -> float:
        """The linear score w1*running/max_running + w2*kv/kv_capacity, request included."""
        req_use, kv_use = self.utilization(request, load)
        return self.running_weight * req_use + self.kv_weight * kv_use

    def _choose(self, request: RoutingRequest, candidates: list[WorkerLoad], now: float) -> str:
        pool = self.eligible(request, candidates)
        if self.scoring == "linear":
            return min(pool, key=lambda ld: (self.score(request, ld), ld.worker_id)).worker_id
        # Fleet means after placing the request somewhere: current mean + its share.
        n = len(candidates)
        mean_req = sum((self.num_reqs(ld) + 1 / n) / ld.max_running_reqs for ld in candidates) / n
        mean_kv = sum(self.kv_usage(ld, request.num_reserved_kv_tokens / n)
                      for ld in candidates) / n

        def rank(ld: WorkerLoad) -> tuple[float, float, str]:
            req_use, kv_use = self.utilization(request, ld)
            worst = max(self.running_weight * req_use / mean_req, self.kv_weight * kv_use / mean_kv)
            return (worst, self.running_weight * req_use + self.kv_weight * kv_use, ld.worker_id)
        return min(pool, key=rank).worker_id


class RoundRobinDecodeRouter(DecodeRouter):
    name = "round-robin"

    def __init__(self, kv_high_watermark: float | None = None,
                 overload_policy: str = "least-loaded", report_lag_s: float = 0.0) -> None:
        super().__init__(kv_high_watermark, overload_policy, report_lag_s)
        self._last_id: str | None = None

    def _choose(self, request: RoutingRequest, candidates: list[WorkerLoad], now: float) -> str:
        pool = self.eligible(request, candidates)
        return next_round_robin([ld.worker_id for ld in pool], self._last_id)

    def on_routed(self, request: RoutingRequest, worker_id: str, now: float) -> None:
        super().on_routed(request, worker_id, now)
        self._last_id = worker_id


class LeastRequestsDecodeRouter(DecodeRouter):
    name = "least-requests"

    def _rank(self, request: RoutingRequest, load: WorkerLoad) -> tuple:
        return (self.num_reqs(load), self.kv_usage(load), load.worker_id)


class LeastKVDecodeRouter(DecodeRouter):
    name = "least-kv"

    def _rank(self, request: RoutingRequest, load: WorkerLoad) -> tuple:
        return (self.kv_usage(load, request.num_reserved_kv_tokens), self.num_reqs(load),
                load.worker_id)


DECODE_POLICIES: dict[str, type[DecodeRouter]] = {
    cls.name: cls for cls in (BalancedDecodeRouter, RoundRobinDecodeRouter,
                              LeastRequestsDecodeRouter, LeastKVDecodeRouter)
}
DEFAULT_DECODE_POLICY = BalancedDecodeRouter.name


def build_decode_router(name: str = DEFAULT_DECODE_POLICY, **kwargs) -> DecodeRouter:
    """A decode router by policy name; options go to its constructor."""
    return build_router(DECODE_POLICIES, "decode", name, kwargs)
