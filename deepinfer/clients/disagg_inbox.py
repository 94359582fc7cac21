"""`WorkerInbox`: reads the one output channel every worker of a disaggregated cluster sends
on, and hands each message where it belongs: deltas and errors to their requests, loads to
the routers, PrefillDone to the decode hand-off, heartbeats / readiness / failures to
`WorkerHealth`. A worker that no longer serves a request cannot write into its stream."""
from __future__ import annotations

import time

from deepinfer.clients.disagg_track import _Track, _worker_error
from deepinfer.wire.worker_messages import (AbortRequests, WorkerFailed, WorkerHeartbeat,
                                        WorkerReady, WorkerReport)


class WorkerInbox:
    """The message side of one `DisaggClient` (it owns the socket and the requests)."""

    def __init__(self, client) -> None:
        self.client = client

    async def run(self) -> None:
        while True:
            message = await self.client._output.receive("a worker")
            if isinstance(message, WorkerReport):
                await self.on_report(message)
                for done in message.prefill_done:
                    track = self.client._requests.get(done.request_id)
                    if track is None or track.prefill_worker != message.worker_id \
                            or track.failed or track.phase != "prefill":
                        await self.client._send(message.worker_id, AbortRequests([done.request_id]))
                        continue
                    self.client.prefill_router.on_prefill_done(done.request_id)  # blocks published
                    await self.client._send_decode(track, done)
            elif isinstance(message, WorkerHeartbeat):
                self.client.health.on_heartbeat(message)
            elif isinstance(message, WorkerReady):
                self.client.health.on_restart_ready(message)
            elif isinstance(message, WorkerFailed):
                await self.client.health.on_worker_dead(
                    message.worker_id,
                    f"worker failed: {message.message.strip().splitlines()[-1]}")
            elif message is not None:  # None: a dropped frame
                self.client._on_other_message(message)

    async def on_report(self, report: WorkerReport) -> None:
        handle = self.client.workers.get(report.worker_id)
        if handle is None:
            return
        now = time.monotonic()
        if not handle.alive:
            if handle.suspended_since is not None:
                self.client.health.resume_worker(handle)  # reports come from the loop: it advanced
            else:
                self.client.health.maybe_readmit(handle)
        if not handle.alive:
            return
        handle.last_seen = handle.last_loop_advance = now
        handle.last_report = report.load
        handle.counters = report.counters
        handle.load = handle.to_worker_load(report.load, now)
        router = self.client.router_of(handle.role)
        router.on_load_report(handle.load)
        for delta in report.outputs:
            track = self.current_track(delta.request_id, report.worker_id)
            if track is None:
                continue
            track.num_tokens_streamed += sum(len(c.token_ids) for c in delta.choices)
            track.last_progress = now
            track.queue.put_nowait(delta)
        for request_id in report.kv_received:
            track = self.current_track(request_id, report.worker_id)
            if track is not None and track.kv_pending:
                track.kv_pending = False
                track.last_progress = now
                prefill = self.client.workers.get(track.prefill_worker)
                if prefill is not None:
                    prefill.request_ids.discard(request_id)
        for error in report.errors:
            track = self.current_track(error.request_id, report.worker_id)
            if track is not None:
                await self.client._give_up(track, _worker_error(error, track.num_tokens_streamed))

    def current_track(self, request_id: str, worker_id: str) -> _Track | None:
        """The live request, if `worker_id` is the one now serving it: a worker that was
        suspended or replaced may still report requests that moved elsewhere."""
        track = self.client._requests.get(request_id)
        if track is None or track.failed:
            return None
        serving = track.prefill_worker if track.phase == "prefill" else track.decode_worker
        return track if serving == worker_id else None
