"""`Router`: the interface every prefill/decode routing policy implements. Pure.

Usage by the front door (or the simulator), with `now` on one clock:

    worker_id = router.route(request, loads, now)   # select + on_routed
    ...
    router.on_load_report(load)                     # each report as it arrives
    router.remove_worker(worker_id)                 # missed heartbeats; returns its reservations

`select` decides without recording anything; `on_routed` records the decision (reservation,
round-robin cursor, counters). `route` does both and is what callers normally use.
Unhealthy workers, removed workers and workers of another role are never picked; when no
worker is left, `NoWorkerAvailable` is raised.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Sequence

from deepinfer.routing.reservation_ledger import Reservation, ReservationLedger, ReservedLoad
from deepinfer.routing.routing_request import RoutingRequest
from deepinfer.routing.worker_load import WorkerLoad


class NoWorkerAvailable(RuntimeError):
    """No healthy worker of the right role can take the request (the caller retries or fails it)."""


class RequestTooLarge(ValueError):
    """No worker could ever hold the request (e.g. its prompt exceeds every decode worker's
    whole KV cache): a client error to refuse at once, not a reason to wait."""


class Router(ABC):
    name: str = "router"
    accepted_roles: tuple[str, ...] = ()

    def __init__(self, report_lag_s: float = 0.0) -> None:
        self.ledger = ReservationLedger(report_lag_s)
        self._removed_ids: set[str] = set()
        self.num_routed: Counter[str] = Counter()  # decisions per worker (a metric)

    # --- decisions -------------------------------------------------------------------------
    @abstractmethod
    def _choose(self, request: RoutingRequest, candidates: list[WorkerLoad], now: float) -> str:
        """Pick one of `candidates` (non-empty, healthy, sorted by worker_id, one per worker)."""

    def select(self, request: RoutingRequest, loads: Sequence[WorkerLoad], now: float) -> str:
        """The worker this policy would pick now. Records nothing but the reports in `loads`
        (and overload counters); call `on_routed` to commit, or use `route`."""
        return self._choose(request, self.candidates(loads), now)

    def on_routed(self, request: RoutingRequest, worker_id: str, now: float) -> None:
        """Record that `request` was sent to `worker_id` at `now` (reserves its load)."""
        self.ledger.reserve(Reservation(
            request_id=request.request_id, worker_id=worker_id, routed_at=now,
            num_uncached_tokens=request.num_uncached_tokens,
            num_kv_tokens=request.num_reserved_kv_tokens,
            predicted_cost_s=self.predicted_cost_s(request)))
        self.num_routed[worker_id] += 1

    def route(self, request: RoutingRequest, loads: Sequence[WorkerLoad], now: float) -> str:
        worker_id = self.select(request, loads, now)
        self.on_routed(request, worker_id, now)
        return worker_id

    def predicted_cost_s(self, request: RoutingRequest) -> float:
        """Predicted compute of `request` on a worker (0 for policies without a cost model)."""
        return 0.0

    # --- bookkeeping -----------------------------------------------------------------------
    def on_load_report(self, load: WorkerLoad) -> None:
        """A new snapshot from a worker: releases the reservations it now includes."""
        self.ledger.observe(load)

    def on_request_aborted(self, request_id: str, worker_id: str | None = None) -> None:
        """The request will never reach its worker: drop its reservation now."""
        self.ledger.release(request_id, worker_id)

    def remove_worker(self, worker_id: str) -> list[Reservation]:
        """Stop routing to `worker_id` until `add_worker`; returns its live reservations."""
        self._removed_ids.add(worker_id)
        return self.ledger.remove_worker(worker_id)

    def add_worker(self, worker_id: str) -> None:
        """(Re-)admit a worker previously removed; new workers need no call."""
        self._removed_ids.discard(worker_id)

    def reserved(self, worker_id: str) -> ReservedLoad:
        return self.ledger.reserved(worker_id)

    def candidates(self, loads: Sequence[WorkerLoad]) -> list[WorkerLoad]:
        """Routable workers: newest snapshot per worker, healthy, right role, not removed.

        Also applies each snapshot to the ledger (idempotent), so callers that only pass
        `loads` to `select` never keep stale reservations.
        """
        newest: dict[str, WorkerLoad] = {}
        for load in loads:
            self.ledger.observe(load)
            seen = newest.get(load.worker_id)
            if seen is None or load.timestamp >= seen.timestamp:
                newest[load.worker_id] = load
        out = [ld for wid, ld in sorted(newest.items())
               if ld.healthy and wid not in self._removed_ids and ld.role in self.accepted_roles
               and self._is_routable(ld)]
        if not out:
            raise NoWorkerAvailable(
                f"{self.name}: no healthy {'/'.join(self.accepted_roles)} worker among "
                f"{len(newest)} reported ({len(self._removed_ids)} removed)")
        return out

    def _is_routable(self, load: WorkerLoad) -> bool:
        return True


def next_round_robin(worker_ids: Sequence[str], last_id: str | None) -> str:
    """The first id after `last_id` in sorted order, wrapping; stable when workers come and go."""
    ordered = sorted(worker_ids)
    if last_id is not None:
        for wid in ordered:
            if wid > last_id:
                return wid
    return ordered[0]


def build_router(policies: dict[str, type[Router]], role: str, name: str, kwargs: dict) -> Router:
    """The `policies[name]` router built with `kwargs`; ValueError names the bad policy or
    options (one message shape for prefill and decode)."""
    cls = policies.get(name)
    if cls is None:
        raise ValueError(f"unknown {role} routing policy {name!r}; "
                         f"choose one of {sorted(policies)}")
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ValueError(f"bad options for {role} policy {name!r}: {exc}") from None
