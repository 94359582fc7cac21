"""`ReservationLedger`: work routed to a worker since that worker's last load report. Pure.

A load report is a snapshot; between two reports the router alone knows what it has sent.
Without reservations a burst of requests between two reports would all see the same snapshot
and pile onto one worker. A reservation counts from the moment its request is routed until a
report from that worker that is newer than the routing time (that report includes the request).

Clock contract: `routed_at` (the router's `now`) and `WorkerLoad.timestamp` must be on the same
clock. The front door should stamp reports with its own receive time, or workers must share
the clock (one machine). `report_lag_s` keeps reservations alive that long past a report, for
requests still in flight to the worker when it took its snapshot.
"""
from __future__ import annotations

from dataclasses import dataclass

from deepinfer.routing.worker_load import WorkerLoad


@dataclass(frozen=True)
class Reservation:
    request_id: str
    worker_id: str
    routed_at: float
    num_uncached_tokens: int  # prefill work the request adds to the worker's queue
    num_kv_tokens: int  # KV the request will hold on the worker (prompt + expected output)
    predicted_cost_s: float = 0.0  # predicted prefill time, when the router has a cost model


@dataclass(frozen=True)
class ReservedLoad:
    """The sum of one worker's live reservations."""

    num_reqs: int = 0
    num_uncached_tokens: int = 0
    num_kv_tokens: int = 0
    predicted_cost_s: float = 0.0


class ReservationLedger:
    """Live reservations per worker, released by newer load reports."""

    def __init__(self, report_lag_s: float = 0.0) -> None:
        if report_lag_s < 0:
            raise ValueError("report_lag_s must be >= 0")
        self.report_lag_s = report_lag_s
        self._by_worker: dict[str, dict[str, Reservation]] = {}
        self._last_report_at: dict[str, float] = {}
        self._totals: dict[str, ReservedLoad] = {}  # cache of reserved(), dropped on change

    def reserve(self, reservation: Reservation) -> None:
        self._by_worker.setdefault(reservation.worker_id, {})[reservation.request_id] = reservation
        self._totals.pop(reservation.worker_id, None)

    def observe(self, load: WorkerLoad) -> int:
        """Apply a load report: release reservations it covers. Returns how many were released.

        Reports older than one already seen for the worker are ignored (out-of-order delivery).
        """
        last = self._last_report_at.get(load.worker_id)
        if last is not None and load.timestamp <= last:
            return 0
        self._last_report_at[load.worker_id] = load.timestamp
        live = self._by_worker.get(load.worker_id)
        if not live:
            return 0
        cutoff = load.timestamp - self.report_lag_s
        covered = [rid for rid, r in live.items() if r.routed_at <= cutoff]
        for rid in covered:
            del live[rid]
        if covered:
            self._totals.pop(load.worker_id, None)
        return len(covered)

    def release(self, request_id: str, worker_id: str | None = None) -> bool:
        """Drop one reservation early (e.g. the request was aborted before reaching the worker)."""
        workers = [worker_id] if worker_id is not None else list(self._by_worker)
        for wid in workers:
            if self._by_worker.get(wid, {}).pop(request_id, None) is not None:
                self._totals.pop(wid, None)
                return True
        return False

    def remove_worker(self, worker_id: str) -> list[Reservation]:
        """Forget a worker; returns its live reservations (requests the caller may re-route)."""
        self._last_report_at.pop(worker_id, None)
        self._totals.pop(worker_id, None)
        return list(self._by_worker.pop(worker_id, {}).values())

    def reserved(self, worker_id: str) -> ReservedLoad:
        totals = self._totals.get(worker_id)
        if totals is None:
            live = self._by_worker.get(worker_id, {}).values()
            totals = ReservedLoad(
                num_reqs=len(live),
                num_uncached_tokens=sum(r.num_uncached_tokens for r in live),
                num_kv_tokens=sum(r.num_kv_tokens for r in live),
                predicted_cost_s=sum(r.predicted_cost_s for r in live))
            self._totals[worker_id] = totals
        return totals

    def num_reservations(self) -> int:
        return sum(len(v) for v in self._by_worker.values())
