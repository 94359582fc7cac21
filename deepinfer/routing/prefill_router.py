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

from collections.abc import Sequence
from dataclasses import dataclass

from deepinfer.core.cost_model import StoreLoadPlan, plan_store_load
from deepinfer.routing.consistent_hash_ring import ConsistentHashRing
from deepinfer.routing.prefill_cost import LinearQuadraticPrefillCost, PrefillCostFn
from deepinfer.routing.prefix_locator import PrefixLocator, PrefixMatch

from deepinfer.routing.router_base import Router, build_router, next_round_robin
from deepinfer.routing.routing_request import RoutingRequest
from deepinfer.routing.worker_load import WorkerLoad


@dataclass(frozen=True)
class PrefixPlan:
    """Where a request goes and what it reuses there. `finish_s`: predicted seconds from now
    until its prefill is done; `own_cost_s`: its own compute and loads. `num_await_blocks`:
    leading blocks this worker waits for in the shared store until `await_until` (router
    clock) instead of computing them (0: no wait): blocks `await_worker` is computing now,
    or (`await_worker` None) blocks just published, whose store write may not have landed
    when the request arrives."""

    worker_id: str
    finish_s: float
    own_cost_s: float
    num_local_blocks: int = 0
    num_load_blocks: int = 0
    num_await_blocks: int = 0
    await_until: float | None = None
    await_worker: str | None = None


class PrefillRouter(Router):
    accepted_roles = ("prefill", "colocated")

    def __init__(self, report_lag_s: float = 0.0) -> None:
        super().__init__(report_lag_s)
        self.num_staging_full = 0  # decisions taken with every worker's staging full (a metric)

    def on_prefill_done(self, request_id: str) -> None:
        """The request's prompt was computed (handed to decode, or finished by its first
        token): its blocks are published. Policies that track prefixes override this."""

    def take_prefix_plan(self, request_id: str) -> PrefixPlan | None:
        """A plan for the prefill worker (await a prefix computed elsewhere), if any."""
        return None

    def select(self, request: RoutingRequest, loads: Sequence[WorkerLoad], now: float) -> str:
        pool = self.candidates(loads)
        with_room = [ld for ld in pool if not ld.staging_full]
        if not with_room:
            self.num_staging_full += 1
        return self._choose(request, with_room or pool, now)


class LeastComputePrefillRouter(PrefillRouter):
    """Earliest predicted prefill finish, plus the compute it takes from the worker.

    Score per worker: queued compute + the request's own cost there (when it would finish)
    + its own cost again (the capacity it takes, which later requests wait for). Without
    prefix knowledge the own cost is the same everywhere and this is least queued compute.

    A worker's queued compute is its reported `predicted_queue_time_s` or, when absent,
    `prefill_cost` over its queued uncached tokens (split evenly over its waiting requests,
    so the quadratic term is not applied to the whole queue as if it were one prompt), plus
    the predicted cost of everything routed to it since that report.

    The request's own cost depends on what each worker can reuse (`PrefixLocator`, built
    from this router's decisions): blocks it computed or is computing now are free; blocks in
    the shared store are loaded or recomputed, whichever is cheaper (`plan_store_load`, at the
    worker's measured store rate `WorkerLoad.store_load_s_per_token` when reported); and a
    prefix being computed on another worker right now can be *awaited*: start once it is
    published (its eta) and load it, instead of computing it a second time. The chosen option
    is kept as a `PrefixPlan` for the front (`take_prefix_plan`). A plan that loads stored
    blocks also asks the worker to wait a little for them (at most what recomputing them
    costs, and `await_slack_s`): the router marks a prefix stored when its prefill is done,
    and the last chunk's store write may still be landing. With `reuse_in_flight` (default)
    options that would compute again part of a prefix being computed now rank last: the
    request waits for it (any worker, loading it once published) or queues behind it on the
    worker computing it, even where recomputing would finish sooner (on a loaded machine the
    duplicate compute delays everything queued after it). Counting the own cost twice
    is what keeps an idle worker from recomputing a prefix that another finishes about as
    soon. Ties go to less own compute, then to the worker holding fewer requests, then to the
    one routed to least recently (idle workers share the work instead of the first taking it).

    Calibration: a worker that reports its measured prefill rate (`compute_s_per_token`) has
    every compute cost scaled by it over the cost model's own rate (`_speed`), so queues, own
    compute and measured store loads are all in that worker's seconds. Without it a slow or
    loaded machine's queues look short next to its real store loads, and a worker holding a
    prefix on device keeps winning requests it cannot serve soon.
    """

    name = "least-compute"
    CALIBRATION_TOKENS = 256  # the prompt size at which the cost model's rate is read

    def __init__(self, prefill_cost: PrefillCostFn | None = None, report_lag_s: float = 0.0,
                 track_prefixes: bool = True, await_slack_s: float = 1.0,
                 reuse_in_flight: bool = True) -> None:
        super().__init__(report_lag_s)
        self.reuse_in_flight = reuse_in_flight  # never recompute a prefix being computed
        self.prefill_cost: PrefillCostFn = prefill_cost or LinearQuadraticPrefillCost()
        self.locator: PrefixLocator | None = PrefixLocator() if track_prefixes else None
        self.await_slack_s = await_slack_s  # how long past its eta a worker awaits a prefix
        self._choice: tuple[str, str, PrefixPlan] | None = None  # (request, worker, plan)
        self._plans: dict[str, PrefixPlan] = {}
        self.num_awaited = 0  # requests sent to await a prefix computed elsewhere (a metric)
        self._last_routed: dict[str, int] = {}  # worker -> decision number (ties rotate)
        self.last_plan: PrefixPlan | None = None  # the last routed request's (for logs)
        self._reported_speeds: dict[str, float] = {}  # worker -> its last measured speed

    def predicted_cost_s(self, request: RoutingRequest) -> float:
        choice = self._choice
        if choice is not None and choice[0] == request.request_id:
            return choice[2].own_cost_s  # the chosen worker's: what it reuses there
        return self._hinted_cost_s(request)

    def _hinted_cost_s(self, request: RoutingRequest, speed: float = 1.0) -> float:
        """Cost with only the request's own hint of cached tokens (no prefix knowledge)."""
        return speed * float(self.prefill_cost(request.num_uncached_tokens,
                                               request.num_cached_tokens))

    def _speed(self, load: WorkerLoad) -> float:
        """The worker's measured prefill seconds per token over the cost model's. A worker that
        has not reported yet (it reports after its first step) takes the mean of its peers'
        reported speeds, else 1: counted at the model's speed next to a peer that measured
        itself 5x slower, it looked 5x faster and took every prompt until it reported."""
        if load.compute_s_per_token:
            return self._measured_speed(load)
        peers = [s for w, s in self._reported_speeds.items() if w != load.worker_id]
        return sum(peers) / len(peers) if peers else 1.0

    def _measured_speed(self, load: WorkerLoad) -> float:
        n = self.CALIBRATION_TOKENS
        model_s_per_token = float(self.prefill_cost(n, 0)) / n
        return load.compute_s_per_token / model_s_per_token if model_s_per_token > 0 else 1.0

    def _record_speeds(self, loads: list[WorkerLoad]) -> None:
        for ld in loads:
            if ld.compute_s_per_token:
                self._reported_speeds[ld.worker_id] = self._measured_speed(ld)

    def on_load_report(self, load: WorkerLoad) -> None:
        super().on_load_report(load)
        self._record_speeds([load])

    def reported_queue_time_s(self, load: WorkerLoad) -> float:
        if load.predicted_queue_time_s is not None:
            return load.predicted_queue_time_s
        tokens = load.num_queued_uncached_tokens
        if tokens == 0:
            return 0.0
        num_reqs = max(1, load.num_waiting_reqs)
        return num_reqs * float(self.prefill_cost(-(-tokens // num_reqs), 0)) * self._speed(load)

    def predicted_queue_time_s(self, load: WorkerLoad) -> float:
        """Time until `load.worker_id` could start a new request, reservations included."""
        return self.reported_queue_time_s(load) + self.reserved(load.worker_id).predicted_cost_s

    def _choose(self, request: RoutingRequest, candidates: list[WorkerLoad], now: float) -> str:
        self._record_speeds(candidates)
        match = (self.locator.match(request.block_hashes)
                 if self.locator is not None and request.block_hashes else None)
        flight = self._num_in_flight_blocks(request, match, candidates)
        best: tuple | None = None
        for ld in candidates:
            num_reqs = ld.num_active_reqs + self.reserved(ld.worker_id).num_reqs
            last = self._last_routed.get(ld.worker_id, -1)
            for plan in self._options(request, ld, match, now):
                recomputed = max(0, flight - plan.num_local_blocks - plan.num_load_blocks)
                key = (recomputed, plan.finish_s + plan.own_cost_s, plan.own_cost_s, num_reqs,
                       last, ld.worker_id)
                if best is None or key < best[0]:
                    best = (key, plan)
        plan = best[1]
        self._choice = (request.request_id, plan.worker_id, plan)
        return plan.worker_id

    def _num_in_flight_blocks(self, request: RoutingRequest, match: PrefixMatch | None,
                              candidates: list[WorkerLoad]) -> int:
        """The longest leading run of the request's blocks being computed now (0: none, or
        `reuse_in_flight` off): options that would compute part of it again rank last."""
        if not self.reuse_in_flight or match is None or not match.in_flight:
            return 0
        usable = (request.num_prompt_tokens - 1) // candidates[0].block_size
        return max(min(f.num_blocks, usable) for f in match.in_flight)

    def _options(self, request: RoutingRequest, ld: WorkerLoad, match: PrefixMatch | None,
                 now: float) -> list[PrefixPlan]:
        """Compute here with what this worker can reuse; or await a prefix in flight."""
        queue_s = self.predicted_queue_time_s(ld)
        if match is None or not (match.num_stored_blocks or match.device_blocks
                                 or match.in_flight):
            own = self._hinted_cost_s(request, self._speed(ld))
            return [PrefixPlan(ld.worker_id, queue_s + own, own)]
        bs = ld.block_size
        usable = (request.num_prompt_tokens - 1) // bs
        local = min(match.num_local_blocks(ld.worker_id), usable)
        stored = max(min(match.num_stored_blocks, usable),
                     min(request.num_cached_tokens // bs, usable))
        plan = self._plan_load(request, ld, local, max(0, stored - local))
        num_wait, wait_until = 0, None
        if plan.num_load_blocks:
            num_wait = local + plan.num_load_blocks
            recompute_s = self._plan_load(request, ld, local, 0).total_s - plan.compute_s
            wait_until = now + min(self.await_slack_s, max(0.0, recompute_s))
        options = [PrefixPlan(ld.worker_id, queue_s + plan.total_s, plan.total_s,
                              num_local_blocks=local, num_load_blocks=plan.num_load_blocks,
                              num_await_blocks=num_wait, await_until=wait_until)]
        for flight in match.in_flight:
            n = min(flight.num_blocks, usable)
            if n <= max(local, stored):  # nothing to wait for (its own, computed in order)
                continue
            plan = self._plan_load(request, ld, local, n - local)
            start = max(queue_s, flight.eta - now)
            options.append(PrefixPlan(ld.worker_id, start + plan.total_s, plan.total_s,
                                      num_local_blocks=local,
                                      num_load_blocks=plan.num_load_blocks,
                                      num_await_blocks=n,
                                      await_until=self._await_deadline(flight.eta, now),
                                      await_worker=flight.worker_id))
        return options

    def _await_deadline(self, eta: float, now: float) -> float:
        """How long a worker waits for a prefix in flight: its eta, plus `await_slack_s` or
        the predicted wait again if longer. On a loaded machine prefills run several times
        slower than predicted, and a wait cut short recomputes what is nearly published."""
        return eta + max(self.await_slack_s, eta - now)

    def _plan_load(self, request: RoutingRequest, ld: WorkerLoad, num_local: int,
                   num_store: int) -> StoreLoadPlan:
        bs = ld.block_size
        rate = ld.store_load_s_per_token or 0.0  # unknown: the cost fn's cached-token charge
        speed = self._speed(ld)
        return plan_store_load(request.num_prompt_tokens, num_local * bs, num_store, bs,
                               lambda k: k * bs * rate,
                               lambda new, ctx: speed * float(self.prefill_cost(new, ctx)))

    def on_routed(self, request: RoutingRequest, worker_id: str, now: float) -> None:
        choice = self._choice
        if choice is None or choice[0] != request.request_id or choice[1] != worker_id:
            own = self._hinted_cost_s(request)  # routed without `select` (or elsewhere)
            self._choice = (request.request_id, worker_id, PrefixPlan(worker_id, own, own))
        plan = self.last_plan = self._choice[2]
        super().on_routed(request, worker_id, now)  # reserves plan.own_cost_s
        self._choice = None
        self._last_routed[worker_id] = sum(self.num_routed.values())
        if plan.num_await_blocks:
            self.num_awaited += plan.await_worker is not None
            self._plans[request.request_id] = plan
        if self.locator is not None and request.block_hashes:
            self.locator.on_routed(request.request_id, worker_id, request.block_hashes,
                                   now + plan.finish_s, plan.num_await_blocks)

    def take_prefix_plan(self, request_id: str) -> PrefixPlan | None:
        """The routed request's plan when it should await blocks in the store (a prefix
        computed elsewhere, or one just published)."""
        return self._plans.pop(request_id, None)

    def on_prefill_done(self, request_id: str) -> None:
        self._plans.pop(request_id, None)
        if self.locator is not None:
            self.locator.on_prefilled(request_id)

    def on_request_aborted(self, request_id: str, worker_id: str | None = None) -> None:
        super().on_request_aborted(request_id, worker_id)
        self._plans.pop(request_id, None)
        if self.locator is not None:
            self.locator.on_aborted(request_id)

    def remove_worker(self, worker_id: str):
        if self.locator is not None:
            self.locator.on_worker_removed(worker_id)
        self._reported_speeds.pop(worker_id, None)
        return super().remove_worker(worker_id)


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
