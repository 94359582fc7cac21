"""Prefill routing policies. Pure.

With a shared prefix store any prefill worker can read any cached prefix, so the default
policy is cache-agnostic: `least-compute` sends a request where its prefill is predicted to
finish first (queued compute + in-flight reservations + its own cost). The others exist for
comparison: `round-robin`, `least-requests`, and `cache-affinity` (consistent hash of the
first blocks, as cache-local systems do).

Policies accept workers with role "prefill" or "colocated". Back-pressure: a worker whose KV
staging is full (`WorkerLoad.staging_full`) is skipped while another has room; when every
worker is full the policy chooses among all of them (each worker queues what it cannot stage
yet, so its host memory stays capped) and `num_staging_full` counts the decision.
"""
from __future__ import annotations

from deepinfer.routing.consistent_hash_ring import ConsistentHashRing
from deepinfer.routing.prefill_cost import LinearQuadraticPrefillCost, PrefillCostFn
from collections.abc import Sequence

from deepinfer.routing.router_base import Router, build_router, next_round_robin
from deepinfer.routing.routing_request import RoutingRequest
from deepinfer.routing.worker_load import WorkerLoad


class PrefillRouter(Router):
    accepted_roles = ("prefill", "colocated")

    def __init__(self, report_lag_s: float = 0.0) -> None:
        super().__init__(report_lag_s)
        self.num_staging_full = 0  # decisions taken with every worker's staging full (a metric)

    def select(self, request: RoutingRequest, loads: Sequence[WorkerLoad], now: float) -> str:
        pool = self.candidates(loads)
        with_room = [ld for ld in pool if not ld.staging_full]
        if not with_room:
            self.num_staging_full += 1
        return self._choose(request, with_room or pool, now)


class LeastComputePrefillRouter(PrefillRouter):
    """Least predicted queued compute; shared-store hits count as cheap cached tokens.

    A worker's queued compute is its reported `predicted_queue_time_s` or, when absent,
    `prefill_cost` over its queued uncached tokens (split evenly over its waiting requests,
    so the quadratic term is not applied to the whole queue as if it were one prompt), plus
    the predicted cost of everything routed to it since that report.
    """

    name = "least-compute"

    def __init__(self, prefill_cost: PrefillCostFn | None = None, report_lag_s: float = 0.0) -> None:
        super().__init__(report_lag_s)
        self.prefill_cost: PrefillCostFn = prefill_cost or LinearQuadraticPrefillCost()

    def predicted_cost_s(self, request: RoutingRequest) -> float:
        return float(self.prefill_cost(request.num_uncached_tokens, request.num_cached_tokens))

    def reported_queue_time_s(self, load: WorkerLoad) -> float:
        if load.predicted_queue_time_s is not None:
            return load.predicted_queue_time_s
        tokens = load.num_queued_uncached_tokens
        if tokens == 0:
            return 0.0
        num_reqs = max(1, load.num_waiting_reqs)
        return num_reqs * float(self.prefill_cost(-(-tokens // num_reqs), 0))

    def predicted_queue_time_s(self, load: WorkerLoad) -> float:
        """Time until `load.worker_id` could start a new request, reservations included."""
        return self.reported_queue_time_s(load) + self.reserved(load.worker_id).predicted_cost_s

    def _choose(self, request: RoutingRequest, candidates: list[WorkerLoad], now: float) -> str:
        # The request's own cost is the same on every worker (the store is shared), so the
        # argmin is over queued compute; ties go to the worker holding fewer requests.
        def key(ld: WorkerLoad) -> tuple[float, int, str]:
            num_reqs = ld.num_active_reqs + self.reserved(ld.worker_id).num_reqs
            return (self.predicted_queue_time_s(ld), num_reqs, ld.worker_id)
        return min(candidates, key=key).worker_id


class RoundRobinPrefillRouter(PrefillRouter):
    name = "round-robin"

    def __init__(self, report_lag_s: float = 0.0) -> None:
        super().__init__(report_lag_s)
        self._last_id: str | None = None

    def _choose(self, request: RoutingRequest, candidates: list[WorkerLoad], now: float) -> str:
        return next_round_robin([ld.worker_id for ld in candidates], self._last_id)

    def on_routed(self, request: RoutingRequest, worker_id: str, now: float) -> None:
        super().on_routed(request, worker_id, now)
        self._last_id = worker_id


class LeastRequestsPrefillRouter(PrefillRouter):
    """Fewest requests held (running + waiting + reserved), ignoring their sizes."""

    name = "least-requests"

    def _choose(self, request: RoutingRequest, candidates: list[WorkerLoad], now: float) -> str:
        def key(ld: WorkerLoad) -> tuple[int, int, str]:
            reserved = self.reserved(ld.worker_id)
            return (ld.num_active_reqs + reserved.num_reqs,
                    ld.num_queued_uncached_tokens + reserved.num_uncached_tokens, ld.worker_id)
        return min(candidates, key=key).worker_id


class CacheAffinityPrefillRouter(PrefillRouter):
    """Consistent hash of the prefix: requests sharing their first blocks go to one worker.

    The key is the chained hash of block `num_affinity_blocks - 1` (or of the last full block
    of a shorter prompt), which identifies the whole leading prefix. Requests without a full
    block go to the worker with the fewest requests. With `max_imbalance_tokens` set, a worker
    whose queued uncached tokens exceed the least queued worker's by more than that is bypassed
    for the least-requests choice (load-balancing escape hatch, off by default).
    """

    name = "cache-affinity"

    def __init__(self, num_affinity_blocks: int = 4, num_virtual_nodes: int = 64,
                 max_imbalance_tokens: int | None = None, report_lag_s: float = 0.0) -> None:
        super().__init__(report_lag_s)
        if num_affinity_blocks < 1:
            raise ValueError("num_affinity_blocks must be >= 1")
        self.num_affinity_blocks = num_affinity_blocks
        self.num_virtual_nodes = num_virtual_nodes
        self.max_imbalance_tokens = max_imbalance_tokens
        self._fallback = LeastRequestsPrefillRouter()
        self._fallback.ledger = self.ledger  # share reservations
        self._ring: ConsistentHashRing | None = None

    def affinity_key(self, request: RoutingRequest) -> bytes | None:
        if not request.block_hashes:
            return None
        return request.block_hashes[min(self.num_affinity_blocks, len(request.block_hashes)) - 1]

    def _ring_for(self, worker_ids: list[str]) -> ConsistentHashRing:
        if self._ring is None or self._ring.worker_ids != frozenset(worker_ids):
            self._ring = ConsistentHashRing(worker_ids, self.num_virtual_nodes)
        return self._ring

    def _choose(self, request: RoutingRequest, candidates: list[WorkerLoad], now: float) -> str:
        key = self.affinity_key(request)
        if key is None:
            return self._fallback._choose(request, candidates, now)
        owner = self._ring_for([ld.worker_id for ld in candidates]).owner(key)
        if self.max_imbalance_tokens is not None:
            queued = {ld.worker_id: ld.num_queued_uncached_tokens
                      + self.reserved(ld.worker_id).num_uncached_tokens for ld in candidates}
            if queued[owner] - min(queued.values()) > self.max_imbalance_tokens:
                return self._fallback._choose(request, candidates, now)
        return owner


PREFILL_POLICIES: dict[str, type[PrefillRouter]] = {
    cls.name: cls for cls in (LeastComputePrefillRouter, RoundRobinPrefillRouter,
                              LeastRequestsPrefillRouter, CacheAffinityPrefillRouter)
}
DEFAULT_PREFILL_POLICY = LeastComputePrefillRouter.name


def build_prefill_router(name: str = DEFAULT_PREFILL_POLICY, **kwargs) -> PrefillRouter:
    """A prefill router by policy name; options go to its constructor."""
    return build_router(PREFILL_POLICIES, "prefill", name, kwargs)
