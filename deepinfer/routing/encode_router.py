"""Encode routing: which encode worker runs a request's vision tower. Pure.

An encode worker's queue is measured in image patches (the vision tower's tokens): its cost is
close to linear in patches, and images of different sizes have different patch counts. The
default `least-patches` policy picks the worker with the fewest queued patches, counting the
patches routed to it since its last load report (`ReservationLedger`, as the prefill and
decode routers do), so a burst of images between two reports spreads out instead of piling on
the worker that looked idle. Ties go to the worker with fewer queued images, then by id.

An encode worker reports its queue in `WorkerLoad.num_queued_uncached_tokens` (queued image
patches) and `num_waiting_reqs` (queued images); role "encode".
"""
from __future__ import annotations

from dataclasses import dataclass

from deepinfer.routing.reservation_ledger import Reservation
from deepinfer.routing.router_base import Router, build_router, next_round_robin
from deepinfer.routing.worker_load import WorkerLoad


@dataclass(frozen=True)
class EncodeRequest:
    """What the encode router knows of one request's images that need encoding."""

    request_id: str
    num_images: int
    num_patches: int  # vision-tower tokens over all its images

    def __post_init__(self) -> None:
        if self.num_images < 1:
            raise ValueError(f"num_images must be >= 1, got {self.num_images}")
        if self.num_patches < self.num_images:
            raise ValueError(f"num_patches must be >= num_images, got {self.num_patches}")


class EncodeRouter(Router):
    accepted_roles = ("encode",)

    def on_routed(self, request: EncodeRequest, worker_id: str, now: float) -> None:
        # Patches ride in the ledger's "uncached tokens" slot: they are the queued work.
        self.ledger.reserve(Reservation(
            request_id=request.request_id, worker_id=worker_id, routed_at=now,
            num_uncached_tokens=request.num_patches, num_kv_tokens=0))
        self.num_routed[worker_id] += 1

    def queued_patches(self, load: WorkerLoad) -> int:
        """Queued patches of `load`'s worker, reservations included."""
        return load.num_queued_uncached_tokens + self.reserved(load.worker_id).num_uncached_tokens

    def queued_images(self, load: WorkerLoad) -> int:
        return load.num_active_reqs + self.reserved(load.worker_id).num_reqs


class LeastPatchesEncodeRouter(EncodeRouter):
    name = "least-patches"

    def _choose(self, request: EncodeRequest, candidates: list[WorkerLoad], now: float) -> str:
        return min(candidates, key=lambda ld: (self.queued_patches(ld), self.queued_images(ld),
                                               ld.worker_id)).worker_id


class RoundRobinEncodeRouter(EncodeRouter):
    name = "round-robin"

    def __init__(self, report_lag_s: float = 0.0) -> None:
        super().__init__(report_lag_s)
        self._last_id: str | None = None

    def _choose(self, request: EncodeRequest, candidates: list[WorkerLoad], now: float) -> str:
        return next_round_robin([ld.worker_id for ld in candidates], self._last_id)

    def on_routed(self, request: EncodeRequest, worker_id: str, now: float) -> None:
        super().on_routed(request, worker_id, now)
        self._last_id = worker_id


ENCODE_POLICIES: dict[str, type[EncodeRouter]] = {
    cls.name: cls for cls in (LeastPatchesEncodeRouter, RoundRobinEncodeRouter)
}
DEFAULT_ENCODE_POLICY = LeastPatchesEncodeRouter.name


def build_encode_router(name: str = DEFAULT_ENCODE_POLICY, **kwargs) -> EncodeRouter:
    """An encode router by policy name; options go to its constructor."""
    return build_router(ENCODE_POLICIES, "encode", name, kwargs)
