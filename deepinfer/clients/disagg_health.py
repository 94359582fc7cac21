"""`WorkerHealth`: liveness of a disaggregated cluster's workers, and what follows from it.

Every worker report is a heartbeat, and the heartbeat thread's `loop_age_s` says when the
engine loop last advanced. A worker whose process exited or that sent `WorkerFailed` is lost
(killed if need be; the supervisor restarts it). A worker silent for `heartbeat_timeout_s`,
or whose loop has not advanced for `loop_stall_timeout_s` (hung step, SIGSTOP), is suspended:
out of routing until its loop advances again, and lost if that takes more than
`hung_restart_after_s`. Either way its requests are retried once on another prefill worker
when nothing was streamed yet, else failed with a clear error.
"""
from __future__ import annotations

import asyncio
import logging
import time

from deepinfer.wire.worker_messages import AbortRequests, WorkerCounters, WorkerHeartbeat, WorkerReady
from deepinfer.cluster.worker_handle import WorkerHandle
from deepinfer.cluster.worker_supervisor import WorkerState, drive_restarts
from deepinfer.engine.exceptions import EngineDeadError

logger = logging.getLogger(__name__)
HEALTH_CHECK_PERIOD_S = 0.1


class WorkerHealth:
    """The health side of one `DisaggClient`: it owns no sockets; it reads the client's
    worker handles and requests and moves, fails or restarts them."""

    def __init__(self, client) -> None:
        self.client = client
        self.num_retried = 0
        self.num_failed_by_worker_loss = 0
        self.num_suspended = 0  # workers taken out of routing as unresponsive (a metric)

    def on_heartbeat(self, beat: WorkerHeartbeat) -> None:
        handle = self.client.workers.get(beat.worker_id)
        if handle is None:
            return
        now = time.monotonic()
        handle.last_seen = now
        handle.last_loop_advance = max(handle.last_loop_advance, now - beat.loop_age_s)
        if handle.suspended_since is not None and \
                handle.last_loop_advance > handle.suspended_since:
            self.resume_worker(handle)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_CHECK_PERIOD_S)
            now = time.monotonic()
            for handle in list(self.client.workers.values()):
                await self.check_worker(handle, now)
            self.supervise_workers(time.monotonic())
            stall_s = self.client.cluster.stall_timeout_s
            for track in list(self.client._requests.values()):
                if not track.failed and now - track.last_progress > stall_s:
                    await self.client._give_up(track, EngineDeadError(
                        f"request made no progress for {stall_s:.0f} s"))

    async def check_worker(self, handle: WorkerHandle, now: float) -> None:
        suspended = handle.suspended_since is not None
        if not (handle.alive or suspended):
            return
        c = self.client.cluster
        if handle.proc is not None and not handle.proc.is_alive():
            await self.on_worker_dead(handle.worker_id, f"process exited ({handle.proc.exitcode})")
        elif suspended:
            if now - handle.suspended_since > c.hung_restart_after_s:
                await self.on_worker_dead(handle.worker_id, f"unresponsive for "
                                          f"{now - handle.suspended_since:.0f} s "
                                          f"({handle.dead_reason})")
        elif now - handle.last_seen > c.heartbeat_timeout_s:
            await self.suspend_worker(handle.worker_id, f"missed heartbeats (silent for "
                                                        f"{now - handle.last_seen:.1f} s)")
        elif now - handle.last_loop_advance > c.loop_stall_timeout_s:
            await self.suspend_worker(handle.worker_id, f"its engine loop has not advanced for "
                                                        f"{now - handle.last_loop_advance:.1f} s")

    async def on_worker_dead(self, worker_id: str, reason: str) -> None:
        """Lost for good (exited, failed, unreachable, or unresponsive too long): kill what is
        left of it; the supervisor decides on a restart."""
        handle = self.client.workers[worker_id]
        if not handle.alive and handle.suspended_since is None:
            return
        logger.error("%s removed from routing: %s", worker_id, reason)
        handle.alive, handle.dead_reason, handle.suspended_since = False, reason, None
        router = self.client.router_of(handle.role)
        router.remove_worker(worker_id)
        await self.release_requests(handle, reason)
        if handle.proc is not None and handle.proc.is_alive():
            handle.proc.kill()  # a hung worker must not come back with stale state
        self.on_worker_lost(handle, reason)

    async def suspend_worker(self, worker_id: str, reason: str) -> None:
        """Unresponsive but not gone: out of routing, its requests retried or failed (and
        aborted on it, which it reads when it resumes), back in routing when it advances."""
        handle = self.client.workers[worker_id]
        if not handle.alive:
            return
        logger.error("%s suspended from routing: %s", worker_id, reason)
        handle.alive, handle.dead_reason = False, reason
        handle.suspended_since = time.monotonic()
        self.num_suspended += 1
        router = self.client.router_of(handle.role)
        router.remove_worker(worker_id)
        await self.release_requests(handle, reason)

    def resume_worker(self, handle: WorkerHandle) -> None:
        now = time.monotonic()
        logger.warning("%s is back in routing after %.1f s unresponsive (%s)", handle.worker_id,
                       now - handle.suspended_since, handle.dead_reason)
        handle.alive, handle.dead_reason, handle.suspended_since = True, None, None
        handle.last_seen = now
        router = self.client.router_of(handle.role)
        router.add_worker(handle.worker_id)

    async def release_requests(self, handle: WorkerHandle, reason: str) -> None:
        """Move or fail every request `handle` holds (it is out of routing already)."""
        worker_id = handle.worker_id
        for request_id in sorted(handle.request_ids):
            track = self.client._requests.get(request_id)
            if track is None or track.failed:
                continue
            if handle.role == "prefill" and track.phase == "prefill" \
                    and track.num_tokens_streamed == 0 and track.num_retries == 0:
                track.num_retries += 1
                self.num_retried += 1
                track.last_progress = time.monotonic()
                await self.client._send(worker_id, AbortRequests([request_id]))  # if it resumes
                self.client.prefill_router.on_request_aborted(request_id, worker_id)
                try:
                    await self.client._send_prefill(track, exclude=worker_id)
                    continue
                except EngineDeadError as exc:
                    reason = f"{reason}; retry impossible: {exc}"
            self.num_failed_by_worker_loss += 1
            # A suspended worker may come back, but its stream cannot continue elsewhere.
            what = "stopped responding" if handle.suspended_since is not None else "was lost"
            if handle.role == "prefill" and track.phase == "decode":
                message = (f"prefill worker {worker_id} {what} ({reason}) before decode "
                           f"worker {track.decode_worker} received the request's KV")
            else:
                message = (f"{handle.role} worker {worker_id} {what} ({reason}) after "
                           f"{track.num_tokens_streamed} streamed tokens")
            # Aborts every other holder too: staged KV, a pull in flight, allocated blocks.
            await self.client._give_up(track, EngineDeadError(message))
        handle.request_ids.clear()

    # --- self-healing (policy and back-off: worker_supervisor) --------------------------------
    def on_worker_lost(self, handle: WorkerHandle, reason: str) -> None:
        decision = self.client.supervisor.on_lost(handle.worker_id, reason, time.monotonic())
        if decision.gave_up:
            logger.error("giving up on %s after %d restarts in a row; it stays out of routing "
                         "(last loss: %s)", handle.worker_id, decision.num_consecutive, reason)
        else:
            logger.warning("%s will be restarted in %.1f s (restart %d in a row)",
                           handle.worker_id, decision.restart_at - time.monotonic(),
                           decision.num_consecutive)

    def supervise_workers(self, now: float) -> None:
        """Start due restarts; a replacement that exited or never became ready is lost again."""
        workers = self.client.workers
        drive_restarts(self.client.supervisor, now, lambda w: workers[w].proc,
                       lambda w, reason: self.on_worker_lost(workers[w], reason),
                       self.restart_worker)

    def restart_worker(self, worker_id: str) -> None:
        """Spawn a fresh process for a lost worker (same id and input socket). It stays out of
        routing until its `WorkerReady` and first report (`_maybe_readmit`)."""
        handle = self.client.workers[worker_id]
        handle.ready = handle.load = handle.last_report = None
        handle.counters = WorkerCounters()  # a new process counts from zero
        handle.request_ids.clear()
        # The new process proves itself again; nothing goes to (or is believed from) the old.
        handle.input_socket.release()
        self.client._output.release(worker_id)
        handle.proc = self.client.launcher.process(handle.spec)
        self.client.supervisor.on_started(worker_id, time.monotonic())
        try:
            handle.proc.start()
        except OSError as exc:  # e.g. out of memory or pids: back off and try again
            handle.proc = None
            self.on_worker_lost(handle, f"could not spawn: {exc}")
            return
        logger.warning("restarting %s (pid %s)", worker_id, handle.proc.pid)

    def on_restart_ready(self, ready: WorkerReady) -> None:
        handle = self.client.workers.get(ready.worker_id)
        if handle is None or handle.alive or handle.proc is None or ready.pid != handle.proc.pid:
            return  # a stale announcement of a process already replaced
        other = self.other_weights(ready)
        if other is not None:  # never routed to: its KV would be wrong on every other worker
            logger.error("%s", other)
            if handle.proc.is_alive():
                handle.proc.kill()
            self.on_worker_lost(handle, other)
            return
        handle.ready = ready

    def other_weights(self, ready: WorkerReady) -> str | None:
        """Why `ready`'s worker must not join (None if it may): KV computed with other weights
        looks like any other KV (same shapes), so a hand-off or a store block between such
        workers would be a silently wrong answer. E.g. a model path that holds other files
        on another machine (Ray)."""
        if not ready.weights_fingerprint:  # nothing to compare: it cannot be trusted with KV
            return (f"{ready.worker_id} reported no weights fingerprint (a build that does "
                    f"not say which files it loaded); its KV could not be checked")
        if not self.client.weights_fingerprint:
            self.client.weights_fingerprint = ready.weights_fingerprint
            return None
        if ready.weights_fingerprint == self.client.weights_fingerprint:
            return None
        return (f"{ready.worker_id} loaded other model files (weights fingerprint "
                f"{ready.weights_fingerprint[:12]}, the cluster's is "
                f"{self.client.weights_fingerprint[:12]}): check that --model names the same "
                f"files on every machine")

    def maybe_readmit(self, handle: WorkerHandle) -> None:
        """A report from a restarted worker that announced itself: route to it again."""
        if handle.ready is None or \
                self.client.supervisor.state(handle.worker_id) is not WorkerState.STARTING:
            return
        now = time.monotonic()
        handle.alive, handle.dead_reason = True, None
        handle.last_seen = handle.last_loop_advance = now  # not the old process's liveness
        router = self.client.router_of(handle.role)
        router.add_worker(handle.worker_id)
        outage = self.client.supervisor.on_admitted(handle.worker_id, now)
        if outage is not None:
            logger.warning("%s is back in routing %.1f s after it was lost (%s)",
                           handle.worker_id, outage.recovery_s, outage.reason)
