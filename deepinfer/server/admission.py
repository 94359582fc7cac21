"""The 429 admission limit (`--max-waiting-requests`), exact under concurrent arrivals.

The client counts a request as waiting only once its engine request has started (sent to the
engine). Between the check and that start the handler may await (a stream is only iterated
after its headers go out; several prompts start in separate tasks), so a check alone would
let every concurrent arrival see the same count and pass. The gate therefore *reserves* the
admitted requests in the same synchronous step as the check, and each reservation is handed
over to the client's own count when its engine request starts (`Admission.start_one`, called
right before the first `generate()` step, with no await in between).

Admission may be taken on the request-preparation thread (`prepare_pool`) while the loop
starts or releases others, so the count is changed under a lock (re-entrant: a release from
`__del__` can run inside a locked section of the same thread).
"""
from __future__ import annotations

import threading
from collections.abc import Callable

from deepinfer.server.errors import APIError


class AdmissionGate:
    """Admits requests while `waiting + reserved + new <= limit` (no limit: always)."""

    def __init__(self, limit: int | None, num_waiting: Callable[[], int]) -> None:
        self.limit = limit
        self.num_waiting = num_waiting  # the client's count of started, not yet running
        self.num_reserved = 0  # admitted, engine request not started yet
        self.lock = threading.RLock()

    def admit(self, num_requests: int) -> Admission:
        """Reserve `num_requests` engine requests, or raise the 429 APIError."""
        with self.lock:
            if self.limit is not None and \
                    self.num_waiting() + self.num_reserved + num_requests > self.limit:
                raise APIError(429, f"Too many waiting requests (limit {self.limit}); retry "
                               "later", type="rate_limit_error", code="rate_limit_exceeded",
                               headers={"Retry-After": "1"})
            self.num_reserved += num_requests
        return Admission(self, num_requests)


class Admission:
    """The reservations of one HTTP request. Released as its engine requests start, or all at
    once by `release()` (also on garbage collection: a stream whose body is never iterated
    -- the client left before it began -- must not hold its slots forever)."""

    def __init__(self, gate: AdmissionGate, num_requests: int) -> None:
        self._gate = gate
        self._left = num_requests

    def start_one(self) -> None:
        """One engine request is starting now; from here the client counts it."""
        with self._gate.lock:
            if self._left > 0:
                self._left -= 1
                self._gate.num_reserved -= 1

    def release(self) -> None:
        with self._gate.lock:
            self._gate.num_reserved -= self._left
            self._left = 0

    def __del__(self) -> None:
        self.release()
