"""Adding and removing prefill/decode workers while serving (`deepinfer scale`,
POST /admin/scale), for every launcher.

    add:     new id (never reused) ─spawn─▶ STARTING ─WorkerReady + first report─▶ routed
             (admitted by the same path as a restarted worker; lost before that: restarted)
    remove:  retired (never restarted) ─▶ out of routing ─▶ drain: its requests finish
             ─▶ ShutdownWorker ─▶ gone;  past `drain_timeout_s` what is left is released
             like a lost worker's (retried when nothing was streamed, else failed clearly)

Which workers go: the ones out of service first (lost, given up), then the newest (last in,
first out: predictable, and the drain makes a busy one safe to remove)."""
from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass, field

from deepinfer.wire.worker_messages import ShutdownWorker
from deepinfer.cluster.worker_spec import CLUSTER_ROLES
from deepinfer.cluster.worker_supervisor import WorkerState

logger = logging.getLogger(__name__)
POLL_S = 0.05
PENDING_GRACE_S = 5.0  # stop waiting for added workers the launcher cannot place now
MAX_WORKERS_PER_ROLE = 1024


@dataclass
class ScaleResult:
    role: str
    count: int
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    not_ready: list[str] = field(default_factory=list)  # added, still loading (wait=False)
    waiting_for: dict[str, str] = field(default_factory=dict)  # not placed yet, and why
    num_released: int = 0  # requests a drain could not finish in time (retried or failed)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def removal_order(workers: list, states: dict[str, WorkerState]) -> list:
    """Which of a role's workers to remove first: out of service, then the newest."""
    def key(h):
        out_of_service = not h.alive or states.get(h.worker_id) is not WorkerState.ALIVE
        return (not out_of_service, -_index(h.worker_id))
    return sorted(workers, key=key)


def _index(worker_id: str) -> int:
    match = re.search(r"-(\d+)$", worker_id)
    return int(match.group(1)) if match else 0


class WorkerScaler:
    """Scales one `DisaggClient` (one scaling at a time)."""

    def __init__(self, client) -> None:
        self.client = client
        self._lock = asyncio.Lock()
        self._next_index = {role: 1 + max((_index(w) for w, h in client.workers.items()
                                           if h.role == role), default=-1)
                            for role in CLUSTER_ROLES}
        self.retiring: set[str] = set()

    def members(self, role: str) -> list:
        return [h for h in self.client.workers.values()
                if h.role == role and h.worker_id not in self.retiring]

    async def scale(self, role: str, count: int, wait: bool = True) -> ScaleResult:
        if role not in CLUSTER_ROLES:
            raise ValueError(f"role must be one of {CLUSTER_ROLES}, got {role!r}")
        if not isinstance(count, int) or isinstance(count, bool) or \
                not 1 <= count <= MAX_WORKERS_PER_ROLE:
            raise ValueError(f"count must be an integer from 1 to {MAX_WORKERS_PER_ROLE} "
                             f"(a disaggregated cluster needs a worker of each role)")
        if getattr(self.client.cluster, "cpu_affinity", False):
            raise ValueError("scaling is not supported with --cpu-affinity (cores are split "
                             "among the workers started with the server)")
        async with self._lock:
            result = ScaleResult(role, count)
            members = self.members(role)
            if count > len(members):
                result.added = [self._add(role) for _ in range(count - len(members))]
                if wait:
                    await self._wait_admitted(result.added)
                result.not_ready = [w for w in result.added if not self.client.workers[w].alive]
                result.waiting_for = {w: r for w in result.not_ready
                                      if (r := self.pending_reason(w)) is not None}
            elif count < len(members):
                states = {h.worker_id: self.client.supervisor.state(h.worker_id)
                          for h in members}
                victims = removal_order(members, states)[:len(members) - count]
                drains = [self._remove(h.worker_id) for h in victims]
                result.removed = [h.worker_id for h in victims]
                if wait:
                    result.num_released = sum(await asyncio.gather(*drains))
                else:
                    for drain in drains:
                        self.client._tasks.append(asyncio.create_task(drain))
            return result

    # --- add ---------------------------------------------------------------------------------
    def _add(self, role: str) -> str:
        c = self.client
        index = self._next_index[role]
        self._next_index[role] += 1
        handle = c._make_handle(role, index)
        handle.alive, handle.dead_reason = False, "starting (added by scaling)"
        c.workers[handle.worker_id] = handle
        c.supervisor.add_starting(handle.worker_id, role, time.monotonic())
        handle.proc = c.launcher.process(handle.spec)
        try:
            handle.proc.start()
        except OSError as exc:  # the supervisor retries it with back-off
            handle.proc = None
            c.health.on_worker_lost(handle, f"could not spawn: {exc}")
        logger.warning("scaling: added %s", handle.worker_id)
        return handle.worker_id

    def pending_reason(self, worker_id: str) -> str | None:
        """Why the launcher has not placed `worker_id` yet (None: placed, or loading)."""
        handle = self.client.workers.get(worker_id)
        reason = getattr(self.client.launcher, "pending_reason", None)
        if handle is None or handle.proc is None or reason is None:
            return None
        return reason(handle.proc)

    async def _wait_admitted(self, worker_ids: list[str]) -> None:
        """Until every added worker serves, gave up, or (for PENDING_GRACE_S) all of those
        left wait for resources the cluster does not have now."""
        c = self.client
        deadline = time.monotonic() + c.cluster.ready_timeout_s
        unplaceable_since = None
        while time.monotonic() < deadline:
            pending = [w for w in worker_ids if w in c.workers and not c.workers[w].alive
                       and c.supervisor.state(w) is not WorkerState.GAVE_UP]
            if not pending:
                return
            if all(self.pending_reason(w) is not None for w in pending):
                unplaceable_since = unplaceable_since or time.monotonic()
                if time.monotonic() - unplaceable_since > PENDING_GRACE_S:
                    return
            else:
                unplaceable_since = None
            await asyncio.sleep(POLL_S)

    # --- remove ------------------------------------------------------------------------------
    async def _remove(self, worker_id: str) -> int:
        """Retire `worker_id`: out of routing now, gone once its requests are done. Returns
        how many requests were still on it at the drain deadline."""
        c = self.client
        handle = c.workers[worker_id]
        self.retiring.add(worker_id)
        c.supervisor.retire(worker_id)
        router = c.prefill_router if handle.role == "prefill" else c.decode_router
        router.remove_worker(worker_id)  # new requests go elsewhere; its own ones continue
        logger.warning("scaling: draining %s (%d requests)", worker_id, len(handle.request_ids))
        deadline = time.monotonic() + c.cluster.drain_timeout_s
        while handle.request_ids and handle.alive and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        num_released = 0
        if handle.request_ids and (handle.alive or handle.suspended_since is not None):
            num_released = len(handle.request_ids)
            await c.health.on_worker_dead(worker_id, f"removed by scaling with {num_released} "
                                          f"requests left after {c.cluster.drain_timeout_s:.0f} s")
        await self._stop(handle)
        router.remove_worker(worker_id)
        c.workers.pop(worker_id, None)
        c.supervisor.remove(worker_id)
        self.retiring.discard(worker_id)
        logger.warning("scaling: removed %s", worker_id)
        return num_released

    async def _stop(self, handle) -> None:
        handle.alive, handle.dead_reason = False, "removed by scaling"  # no loss handling
        handle.suspended_since = None
        proc = handle.proc
        if proc is not None and proc.is_alive() and handle.ready is None:
            proc.kill()  # never announced itself (loading, or not even placed): nothing to end
        elif proc is not None and proc.is_alive():
            try:
                await handle.input_socket.send(handle.sender.encode(ShutdownWorker()))
            except Exception:  # zmq.Again: it reads nothing any more; killed below
                pass
            await asyncio.to_thread(proc.join, 10)
            if proc.is_alive():
                proc.kill()
        handle.input_socket.close(linger=0)


def describe_workers(client) -> list[dict]:
    """Role, state, requests and placement of every worker (sorted by id)."""
    retiring = client.scaler.retiring if client.scaler is not None else set()
    out = []
    for wid, h in sorted(client.workers.items()):
        state = "retiring" if wid in retiring else (
            "suspended" if h.suspended_since is not None else
            client.supervisor.state(wid).value if not h.alive else "alive")
        placement = client.launcher.placement(h.proc) if h.proc is not None else {}
        out.append({"worker_id": wid, "role": h.role, "state": state,
                    "num_requests": len(h.request_ids), "reason": h.dead_reason,
                    "kv_addr": h.ready.kv_addr if h.ready is not None else None,
                    "placement": placement,
                    "waiting_for": client.scaler.pending_reason(wid)
                    if client.scaler is not None and not h.alive else None})
    return out
