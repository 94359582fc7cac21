"""`DisaggClient`: the front door's client of a disaggregated cluster (drop-in for
`server.engine_client.EngineClient`: same `generate` / `abort` / `start` / `shutdown`).

    generate ─▶ prefill router ─PrefillRequest─▶ prefill worker ─first token─▶ client
                                                      │ PrefillDone
               decode router ◀────────────────────────┘
                    └─DecodeRequest─▶ decode worker ─pulls KV─▶ ... ─tokens─▶ client

Health: every worker report is a heartbeat, and the heartbeat thread's `loop_age_s` says when
the engine loop last advanced. A worker whose process exited or that sent `WorkerFailed` is
lost (killed if need be; the supervisor restarts it). A worker silent for
`heartbeat_timeout_s`, or whose loop has not advanced for `loop_stall_timeout_s` (hung step,
SIGSTOP), is suspended: out of routing until its loop advances again, and lost if that takes
more than `hung_restart_after_s`. Either way its requests are retried once on another
prefill worker when nothing was streamed yet, else failed with a clear error.

Giving up on a request (worker loss, worker error, no progress for `stall_timeout_s`, client
gone) sends an abort to every worker that may hold state for it: the prefill worker (its KV
may be staged, waiting for a pull) and the decode worker (blocks allocated, pull in flight).
A prompt that no decode worker's whole KV cache can hold is refused before prefill (400).
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass

import zmq
import zmq.asyncio

from deepinfer.cluster.cluster_config import ClusterConfig
from deepinfer.cluster.cluster_metrics import spec_decode_totals
from deepinfer.cluster.messages import (AbortRequests, DebugHangLoop, DecodeRequest,
                                        PrefillDone, PrefillRequest, ShutdownWorker, WorkerFailed,
                                        WorkerHeartbeat,
                                        WorkerLoadReport,
                                        WorkerCounters, WorkerMessage, WorkerReady,
                                        WorkerReport)
from deepinfer.cluster.worker_channels import (SEND_TIMEOUT_MS, bind_worker_input,
                                               bind_worker_output, stop_worker_processes)
from deepinfer.cluster.worker_handle import WorkerHandle
from deepinfer.cluster.launcher import LocalLauncher, WorkerLauncher
from deepinfer.cluster.worker_spec import WorkerSpec
from deepinfer.cluster.worker_startup import await_workers_ready
from deepinfer.cluster.worker_supervisor import WorkerState, WorkerSupervisor
from deepinfer.core.prefix_hash import hash_request_blocks
from deepinfer.multimodal.mm_inputs import MultiModalInputs
from deepinfer.routing import (NoWorkerAvailable, RequestTooLarge, RoutingRequest,
                               build_decode_router, build_prefill_router)
from deepinfer.sampling_params import SamplingParams
from deepinfer.server.engine_client import EngineDeadError, RequestFailedError
from deepinfer.server.messages import (EngineStatsSnapshot, RequestDelta, RequestError,
                                       rejection_error)
from deepinfer.server.zmq_inbox import receive_message
from deepinfer.wire import ChannelReceiver, channel_name, tokenizer_from_files
from deepinfer.wire.drops import sum_reports

logger = logging.getLogger(__name__)
HEALTH_CHECK_PERIOD_S = 0.1
MAX_PLACEMENTS = 4096  # recent request -> workers history kept for metrics and debugging


def _worker_error(error: RequestError, num_tokens_streamed: int) -> Exception:
    """A worker's error as the front raises it: a step that failed while running the request
    (500 request_failed), a refusal before anything was streamed (400), else a lost stream."""
    if error.failed:
        return RequestFailedError(error.message, error.engine_fault)
    if num_tokens_streamed == 0:
        return rejection_error(error)
    return EngineDeadError(error.message)


@dataclass(frozen=True)
class _Failed:
    """Queued to a request's consumer: raise `error`."""

    error: Exception


@dataclass
class _Track:
    """The front's record of one request in flight."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    queue: asyncio.Queue
    phase: str = "prefill"  # -> "decode"
    prefill_worker: str | None = None
    decode_worker: str | None = None
    num_tokens_streamed: int = 0
    num_retries: int = 0
    last_progress: float = 0.0
    kv_pending: bool = False  # staged on the prefill worker, not yet received by decode
    mm_inputs: MultiModalInputs | None = None  # image placeholders (pixels: no encode stage)
    failed: bool = False  # the consumer was handed an error
    aborted: bool = False  # aborts were sent to every worker holding state


class DisaggClient:
    def __init__(self, engine_config, cluster: ClusterConfig,
                 launcher: WorkerLauncher | None = None) -> None:
        self.engine_config = engine_config
        self.cluster = cluster
        self.launcher = launcher or LocalLauncher()  # where workers run (local, Ray)
        self.scaler = None  # worker_scaling.WorkerScaler, made on the first scale()
        self.model_name = ""
        self.max_model_len = 0
        self.vocab_size = 0
        self.tokenizer = None
        self.weights_fingerprint = ""  # the first ready worker's; every other must match
        self.dead_message: str | None = None
        self.prefill_router = build_prefill_router(cluster.prefill_router)
        self.decode_router = build_decode_router(cluster.decode_router)
        self.workers: dict[str, WorkerHandle] = {}
        self._requests: dict[str, _Track] = {}
        self._tasks: list[asyncio.Task] = []
        self.num_retried = 0
        # request id -> [prefill worker, decode worker] of recent requests (bounded).
        self.placements: OrderedDict[str, list[str | None]] = OrderedDict()
        self.num_failed_by_worker_loss = 0
        self.num_suspended = 0  # workers taken out of routing as unresponsive (a metric)
        self.supervisor = WorkerSupervisor(cluster.restart_policy)  # restarts lost workers
        self.encode_stage = None  # E/P/D: encode workers (cluster/encode_stage.py)
        if cluster.num_encode_workers:
            from deepinfer.cluster.encode_stage import EncodeStage, EncodeStageConfig
            self.encode_stage = EncodeStage(engine_config, EncodeStageConfig(
                num_workers=cluster.num_encode_workers, router=cluster.encode_router,
                kv_store_url=cluster.store_url, cache_bytes=cluster.encode_cache_bytes,
                host=cluster.host, ready_timeout_s=cluster.ready_timeout_s,
                encode_timeout_s=cluster.stall_timeout_s, log_level=cluster.log_level,
                restart=cluster.restart_policy))
        self._ctx = zmq.asyncio.Context()
        self._output, self._output_addr = bind_worker_output(self._ctx, cluster.host)
        self._decoder = ChannelReceiver(channel_name("worker.output", self._output_addr),
                                        self._worker_message_type())

    def _worker_message_type(self):
        """What workers may send on the shared output channel (a subclass adds its own)."""
        return WorkerMessage

    # --- lifecycle ---------------------------------------------------------------------------
    def _make_handle(self, role: str, index: int) -> WorkerHandle:
        c = self.cluster
        sock, input_addr = bind_worker_input(self._ctx, c.host)
        spec = WorkerSpec(
            worker_id=f"{role}-{index}", role=role, engine_config=self.engine_config,
            input_addr=input_addr, output_addr=self._output_addr,
            parent_pid=os.getpid(), kv_store_url=c.store_url,  # decode: image embeddings only
            report_interval_s=c.report_interval_s, transfer_timeout_s=c.transfer_timeout_s,
            kv_stage_ttl_s=c.kv_stage_ttl_s, host=c.host, log_level=c.log_level,
            debug_transfer_delay_s=c.debug_transfer_delay_s, max_staged_bytes=c.max_staged_bytes,
            cpu_ids=self._cpu_ids(role, index))
        return WorkerHandle(spec, sock)

    def _cpu_ids(self, role: str, index: int) -> tuple[int, ...] | None:
        """--cpu-affinity: prefill workers take the first core groups, decode the next."""
        c = self.cluster
        if not c.cpu_affinity:
            return None
        from deepinfer.cluster.cpu_affinity import assign_cpus, available_cpus
        groups = assign_cpus(c.num_prefill_workers + c.num_decode_workers, available_cpus())
        return groups[index if role == "prefill" else c.num_prefill_workers + index]

    async def start(self) -> None:
        """Spawn every worker and wait until all have loaded the model."""
        self.launcher.check(self.cluster)
        handles = [self._make_handle("prefill", i) for i in range(self.cluster.num_prefill_workers)]
        handles += [self._make_handle("decode", i) for i in range(self.cluster.num_decode_workers)]
        for handle in handles:
            self.workers[handle.worker_id] = handle
            handle.proc = self.launcher.process(handle.spec)
            handle.proc.start()
        if self.encode_stage is not None:  # encode workers load while P/D workers do
            await asyncio.gather(self._wait_ready(), self.encode_stage.start())
        else:
            await self._wait_ready()
        now = time.monotonic()
        for handle in self.workers.values():
            handle.last_seen = handle.last_loop_advance = now
            self.supervisor.add_worker(handle.worker_id, handle.role, now)
            if handle.load is None:  # routable before its first report: an empty worker
                r = handle.ready
                handle.last_report = WorkerLoadReport(0, 0, 0, 0, r.num_kv_blocks, r.block_size,
                                                      0, r.max_num_seqs)
                handle.load = handle.to_worker_load(handle.last_report, now)
        self._tasks = [asyncio.create_task(self._output_loop(), name="cluster-output-loop"),
                       asyncio.create_task(self._health_loop(), name="cluster-health-loop")]

    async def _wait_ready(self) -> None:
        await await_workers_ready(self._output, self._decoder, self.workers,
                                  self.cluster.ready_timeout_s, "workers", self._on_startup_message)

    async def _on_startup_message(self, message) -> str | None:
        if isinstance(message, WorkerReady):
            other = self._other_weights(message)
            if other is not None:
                raise EngineDeadError(other)
            self.workers[message.worker_id].ready = message
            if self.tokenizer is None:
                self.model_name = message.model_name
                self.max_model_len = message.max_model_len
                self.vocab_size = message.vocab_size
                self.tokenizer = tokenizer_from_files(message.tokenizer_files)
            return message.worker_id
        if isinstance(message, WorkerReport):
            await self._on_report(message)
        return None

    async def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        await stop_worker_processes((h.proc, h.input_socket, h.sender.encode(ShutdownWorker()))
                                    for h in self.workers.values())
        self._output.close(linger=0)
        self._ctx.term()
        if self.encode_stage is not None:
            await self.encode_stage.shutdown()
        self.launcher.close()

    async def scale(self, role: str, count: int, wait: bool = True) -> dict:
        """Add or remove `role` workers while serving (removed ones drain first)."""
        from deepinfer.cluster.worker_scaling import WorkerScaler
        self.scaler = self.scaler or WorkerScaler(self)
        return (await self.scaler.scale(role, count, wait)).to_dict()

    def describe_workers(self) -> list[dict]:
        """Each worker's role, state and placement (GET /admin/workers)."""
        from deepinfer.cluster.worker_scaling import describe_workers
        return describe_workers(self)

    def register_metrics(self, registry) -> None:
        """Expose per-worker metrics on the server's Prometheus registry."""
        from deepinfer.cluster.cluster_metrics import ClusterCollector
        registry.register(ClusterCollector(self))
        if self.encode_stage is not None:
            from deepinfer.cluster.encode_metrics import EncodeCollector
            registry.register(EncodeCollector(self.encode_stage))

    @property
    def is_healthy(self) -> bool:
        # Encode workers down (restarting) fail only image requests ("no encode worker
        # available"); text requests are still served.
        roles = {h.role for h in self.workers.values() if h.alive and h.ready is not None}
        return self.dead_message is None and roles == {"prefill", "decode"}

    @property
    def num_waiting_requests(self) -> int:
        return sum(1 for t in self._requests.values() if t.num_tokens_streamed == 0)

    @property
    def stats(self) -> EngineStatsSnapshot:
        """Cluster-wide gauges for the colocated metrics (per-worker ones: `cluster_metrics`)."""
        reports = [h.last_report for h in self.workers.values() if h.alive and h.last_report]
        used = sum(r.num_kv_blocks_used for r in reports)
        total = sum(r.num_kv_blocks_total for r in reports)
        counters = [h.counters for h in self.workers.values()]
        return EngineStatsSnapshot(
            num_running=sum(r.num_running_reqs for r in reports),
            num_waiting=sum(r.num_waiting_reqs for r in reports),
            kv_cache_usage=used / total if total else 0.0, num_kv_blocks_used=used,
            num_kv_blocks_total=total,
            prefix_cache_queries=sum(c.prefix_query_tokens for c in counters),
            prefix_cache_hits=sum(c.device_hit_tokens + c.store_hit_tokens + c.host_hit_tokens
                                  for c in counters),
            num_failed_steps=sum(c.num_failed_steps for c in counters),
            num_failed_requests=sum(c.num_failed_requests for c in counters),
            wire_frames_dropped=sum_reports([c.wire_frames_dropped for c in counters] + (
                [w.counters.wire_frames_dropped for w in self.encode_stage.workers.values()]
                if self.encode_stage is not None else [])),
            **spec_decode_totals(counters))

    # --- requests ----------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, arrival_time: float | None = None,
                       mm_inputs: MultiModalInputs | None = None,
                       ) -> AsyncIterator[RequestDelta]:
        """Yield the request's deltas until it finishes; see `EngineClient.generate`.
        `mm_inputs`: the prompt's images; with encode workers they are encoded there first
        and the prefill worker gets only the placeholders (it fetches the embeddings)."""
        if not self.is_healthy:
            raise EngineDeadError(self.dead_message or "the cluster has no live prefill or "
                                  "decode worker")
        if params.n != 1:
            raise ValueError("disaggregated serving supports n=1 only")
        if request_id in self._requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        self._check_decode_fit(request_id, len(prompt_token_ids))
        arrival_time = arrival_time or time.monotonic()
        if mm_inputs is not None and self.encode_stage is not None and mm_inputs.pixel_values:
            await self.encode_stage.encode(request_id, mm_inputs)  # ValueError: a bad image
            mm_inputs = mm_inputs.without_pixels()
        track = _Track(request_id, list(prompt_token_ids), params, arrival_time,
                       asyncio.Queue(), last_progress=time.monotonic(), mm_inputs=mm_inputs)
        self._requests[request_id] = track
        finished = False
        try:
            await self._send_prefill(track, exclude=None)
            while not finished:
                item = await track.queue.get()
                if isinstance(item, _Failed):
                    raise item.error
                finished = item.finished
                yield item
        finally:
            self._requests.pop(request_id, None)
            if not finished:  # failed, or the client went away: free every worker's state
                await self._abort_track(track)
            else:  # e.g. finished by its first token: no PrefillDone, but its blocks are out
                self.prefill_router.on_prefill_done(request_id)
            self._forget_placement(track)

    async def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            track = self._requests.get(request_id)
            if track is not None:
                await self._abort_track(track)

    def _check_decode_fit(self, request_id: str, num_prompt_tokens: int) -> None:
        """Refuse (ValueError -> 400) a prompt no decode worker could ever hold, before any
        prefill compute is spent on it; it would otherwise wait for room that never comes."""
        if num_prompt_tokens < 1:
            return  # the prefill worker rejects an empty prompt with its own message
        try:
            self.decode_router.check_fits(RoutingRequest(request_id, num_prompt_tokens),
                                          self._loads("decode"))
        except NoWorkerAvailable:
            pass  # transient: decided when the request reaches decode
        except RequestTooLarge as exc:
            raise ValueError(str(exc)) from None

    async def _abort_track(self, track: _Track) -> None:
        """Abort the request on every worker that may hold state for it (idempotent)."""
        if track.aborted:
            return
        track.aborted = True
        for wid, router in ((track.prefill_worker, self.prefill_router),
                            (track.decode_worker, self.decode_router)):
            if wid is not None:
                await self._send(wid, AbortRequests([track.request_id]))
                router.on_request_aborted(track.request_id, wid)

    async def _give_up(self, track: _Track, error: Exception) -> None:
        """Fail the request to its consumer and free its state on every worker at once (not
        when the consumer gets round to it, nor at the staged KV's TTL)."""
        if track.failed:
            return
        track.failed = True
        track.queue.put_nowait(_Failed(error))
        await self._abort_track(track)

    def _forget_placement(self, track: _Track) -> None:
        for wid in (track.prefill_worker, track.decode_worker):
            if wid in self.workers:
                self.workers[wid].request_ids.discard(track.request_id)

    async def _send(self, worker_id: str, message) -> None:
        handle = self.workers.get(worker_id)
        # A suspended worker still gets messages (aborts): it reads them when it resumes.
        if handle is None or not (handle.alive or handle.suspended_since is not None):
            return
        try:
            await handle.input_socket.send(handle.sender.encode(message), copy=False)
        except zmq.Again:
            # Not awaited here: worker-loss handling sends to other workers and fails requests.
            self._tasks.append(asyncio.get_running_loop().create_task(self._on_worker_dead(
                worker_id, f"its input socket accepted nothing for {SEND_TIMEOUT_MS} ms")))

    def _loads(self, role: str):
        return [h.load for h in self.workers.values()
                if h.role == role and h.alive and h.load is not None]

    async def _send_prefill(self, track: _Track, exclude: str | None) -> None:
        block_size = self.engine_config.block_size
        routing = RoutingRequest(
            request_id=track.request_id, num_prompt_tokens=len(track.prompt_token_ids),
            block_hashes=hash_request_blocks(
                track.prompt_token_ids, block_size,
                images=track.mm_inputs.placeholders if track.mm_inputs is not None else (),
                cache_salt=track.params.cache_salt))
        loads = [ld for ld in self._loads("prefill") if ld.worker_id != exclude]
        try:
            worker_id = self.prefill_router.route(routing, loads, time.monotonic())
        except NoWorkerAvailable as exc:
            raise EngineDeadError(str(exc)) from None
        track.phase, track.prefill_worker, track.kv_pending = "prefill", worker_id, False
        self._place(track.request_id, 0, worker_id)
        self.workers[worker_id].request_ids.add(track.request_id)
        plan = self.prefill_router.take_prefix_plan(track.request_id)  # await a prefix?
        await_s = max(0.0, plan.await_until - time.monotonic()) if plan is not None else 0.0
        await self._send(worker_id, PrefillRequest(
            track.request_id, track.prompt_token_ids, track.params, track.arrival_time,
            num_await_blocks=plan.num_await_blocks if plan is not None else 0,
            await_timeout_s=await_s, mm_inputs=track.mm_inputs))

    async def _send_decode(self, track: _Track, done: PrefillDone) -> None:
        expected = track.params.max_tokens or 256
        routing = RoutingRequest(request_id=track.request_id,
                                 num_prompt_tokens=len(track.prompt_token_ids),
                                 expected_output_tokens=expected)
        try:
            worker_id = self.decode_router.route(routing, self._loads("decode"), time.monotonic())
        except (NoWorkerAvailable, RequestTooLarge) as exc:
            await self._give_up(track, EngineDeadError(f"no decode worker available: {exc}"))
            return
        # The prefill worker keeps holding the request until the decode worker reports its
        # KV received (`kv_received`): losing it before then fails the request.
        track.phase, track.decode_worker, track.kv_pending = "decode", worker_id, True
        self._place(track.request_id, 1, worker_id)
        self.workers[worker_id].request_ids.add(track.request_id)
        await self._send(worker_id, DecodeRequest(
            request_id=track.request_id, prompt_token_ids=track.prompt_token_ids,
            sampling_params=track.params, arrival_time=track.arrival_time,
            first_token_id=done.first_token_id, first_logprob=done.first_logprob,
            num_text_chars_sent=done.num_text_chars_sent, kv_source_addr=done.kv_addr,
            num_kv_bytes=done.num_kv_bytes, num_cached_tokens=done.num_cached_tokens,
            mm_inputs=track.mm_inputs.without_pixels() if track.mm_inputs is not None else None))

    def _place(self, request_id: str, stage: int, worker_id: str) -> None:
        self.placements.setdefault(request_id, [None, None])[stage] = worker_id
        self.placements.move_to_end(request_id)
        while len(self.placements) > MAX_PLACEMENTS:
            self.placements.popitem(last=False)

    async def hang_worker_loop(self, worker_id: str, release_path: str,
                               max_s: float = 600.0) -> None:
        """Fault injection (tests, chaos runs): `worker_id`'s engine loop stops advancing until
        the file `release_path` exists (its heartbeat thread keeps beating)."""
        await self._send(worker_id, DebugHangLoop(release_path, max_s))

    # --- worker messages ---------------------------------------------------------------------
    async def _output_loop(self) -> None:
        while True:
            message = await receive_message(self._output, self._decoder.decode, "a worker")
            if isinstance(message, WorkerReport):
                await self._on_report(message)
                for done in message.prefill_done:
                    track = self._requests.get(done.request_id)
                    if track is None or track.prefill_worker != message.worker_id \
                            or track.failed or track.phase != "prefill":
                        await self._send(message.worker_id, AbortRequests([done.request_id]))
                        continue
                    self.prefill_router.on_prefill_done(done.request_id)  # blocks published
                    await self._send_decode(track, done)
            elif isinstance(message, WorkerHeartbeat):
                self._on_heartbeat(message)
            elif isinstance(message, WorkerReady):
                self._on_worker_restart_ready(message)
            elif isinstance(message, WorkerFailed):
                await self._on_worker_dead(message.worker_id, f"worker failed: "
                                           f"{message.message.strip().splitlines()[-1]}")
            elif message is not None:  # None: a dropped frame
                self._on_other_message(message)

    def _on_other_message(self, message) -> None:
        """A message a subclass added to the worker protocol (its `_decoder` reads it), e.g.
        the EPLB results of an expert-parallel decode group."""

    def _on_heartbeat(self, beat: WorkerHeartbeat) -> None:
        handle = self.workers.get(beat.worker_id)
        if handle is None:
            return
        now = time.monotonic()
        handle.last_seen = now
        handle.last_loop_advance = max(handle.last_loop_advance, now - beat.loop_age_s)
        if handle.suspended_since is not None and \
                handle.last_loop_advance > handle.suspended_since:
            self._resume_worker(handle)

    async def _on_report(self, report: WorkerReport) -> None:
        handle = self.workers.get(report.worker_id)
        if handle is None:
            return
        now = time.monotonic()
        if not handle.alive:
            if handle.suspended_since is not None:
                self._resume_worker(handle)  # reports come from the loop: it advanced
            else:
                self._maybe_readmit(handle)
        if not handle.alive:
            return
        handle.last_seen = handle.last_loop_advance = now
        handle.last_report = report.load
        handle.counters = report.counters
        handle.load = handle.to_worker_load(report.load, now)
        router = self.prefill_router if handle.role == "prefill" else self.decode_router
        router.on_load_report(handle.load)
        for delta in report.outputs:
            track = self._current_track(delta.request_id, report.worker_id)
            if track is None:
                continue
            track.num_tokens_streamed += sum(len(c.token_ids) for c in delta.choices)
            track.last_progress = now
            track.queue.put_nowait(delta)
        for request_id in report.kv_received:
            track = self._current_track(request_id, report.worker_id)
            if track is not None and track.kv_pending:
                track.kv_pending = False
                track.last_progress = now
                prefill = self.workers.get(track.prefill_worker)
                if prefill is not None:
                    prefill.request_ids.discard(request_id)
        for error in report.errors:
            track = self._current_track(error.request_id, report.worker_id)
            if track is not None:
                await self._give_up(track, _worker_error(error, track.num_tokens_streamed))

    def _current_track(self, request_id: str, worker_id: str) -> _Track | None:
        """The live request, if `worker_id` is the one now serving it: a worker that was
        suspended or replaced may still report requests that moved elsewhere."""
        track = self._requests.get(request_id)
        if track is None or track.failed:
            return None
        serving = track.prefill_worker if track.phase == "prefill" else track.decode_worker
        return track if serving == worker_id else None

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_CHECK_PERIOD_S)
            now = time.monotonic()
            for handle in list(self.workers.values()):
                await self._check_worker(handle, now)
            self._supervise_workers(time.monotonic())
            for track in list(self._requests.values()):
                if not track.failed and now - track.last_progress > self.cluster.stall_timeout_s:
                    await self._give_up(track, EngineDeadError(
                        f"request made no progress for {self.cluster.stall_timeout_s:.0f} s"))

    async def _check_worker(self, handle: WorkerHandle, now: float) -> None:
        suspended = handle.suspended_since is not None
        if not (handle.alive or suspended):
            return
        c = self.cluster
        if handle.proc is not None and not handle.proc.is_alive():
            await self._on_worker_dead(handle.worker_id, f"process exited ({handle.proc.exitcode})")
        elif suspended:
            if now - handle.suspended_since > c.hung_restart_after_s:
                await self._on_worker_dead(handle.worker_id, f"unresponsive for "
                                           f"{now - handle.suspended_since:.0f} s "
                                           f"({handle.dead_reason})")
        elif now - handle.last_seen > c.heartbeat_timeout_s:
            await self._suspend_worker(handle.worker_id, f"missed heartbeats (silent for "
                                                         f"{now - handle.last_seen:.1f} s)")
        elif now - handle.last_loop_advance > c.loop_stall_timeout_s:
            await self._suspend_worker(handle.worker_id, f"its engine loop has not advanced for "
                                                         f"{now - handle.last_loop_advance:.1f} s")

    async def _on_worker_dead(self, worker_id: str, reason: str) -> None:
        """Lost for good (exited, failed, unreachable, or unresponsive too long): kill what is
        left of it; the supervisor decides on a restart."""
        handle = self.workers[worker_id]
        if not handle.alive and handle.suspended_since is None:
            return
        logger.error("%s removed from routing: %s", worker_id, reason)
        handle.alive, handle.dead_reason, handle.suspended_since = False, reason, None
        router = self.prefill_router if handle.role == "prefill" else self.decode_router
        router.remove_worker(worker_id)
        await self._release_requests(handle, reason)
        if handle.proc is not None and handle.proc.is_alive():
            handle.proc.kill()  # a hung worker must not come back with stale state
        self._on_worker_lost(handle, reason)

    async def _suspend_worker(self, worker_id: str, reason: str) -> None:
        """Unresponsive but not gone: out of routing, its requests retried or failed (and
        aborted on it, which it reads when it resumes), back in routing when it advances."""
        handle = self.workers[worker_id]
        if not handle.alive:
            return
        logger.error("%s suspended from routing: %s", worker_id, reason)
        handle.alive, handle.dead_reason = False, reason
        handle.suspended_since = time.monotonic()
        self.num_suspended += 1
        router = self.prefill_router if handle.role == "prefill" else self.decode_router
        router.remove_worker(worker_id)
        await self._release_requests(handle, reason)

    def _resume_worker(self, handle: WorkerHandle) -> None:
        now = time.monotonic()
        logger.warning("%s is back in routing after %.1f s unresponsive (%s)", handle.worker_id,
                       now - handle.suspended_since, handle.dead_reason)
        handle.alive, handle.dead_reason, handle.suspended_since = True, None, None
        handle.last_seen = now
        router = self.prefill_router if handle.role == "prefill" else self.decode_router
        router.add_worker(handle.worker_id)

    async def _release_requests(self, handle: WorkerHandle, reason: str) -> None:
        """Move or fail every request `handle` holds (it is out of routing already)."""
        worker_id = handle.worker_id
        for request_id in sorted(handle.request_ids):
            track = self._requests.get(request_id)
            if track is None or track.failed:
                continue
            if handle.role == "prefill" and track.phase == "prefill" \
                    and track.num_tokens_streamed == 0 and track.num_retries == 0:
                track.num_retries += 1
                self.num_retried += 1
                track.last_progress = time.monotonic()
                await self._send(worker_id, AbortRequests([request_id]))  # if it resumes
                self.prefill_router.on_request_aborted(request_id, worker_id)
                try:
                    await self._send_prefill(track, exclude=worker_id)
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
            await self._give_up(track, EngineDeadError(message))
        handle.request_ids.clear()

    # --- self-healing (policy and back-off: worker_supervisor) --------------------------------
    def _on_worker_lost(self, handle: WorkerHandle, reason: str) -> None:
        decision = self.supervisor.on_lost(handle.worker_id, reason, time.monotonic())
        if decision.gave_up:
            logger.error("giving up on %s after %d restarts in a row; it stays out of routing "
                         "(last loss: %s)", handle.worker_id, decision.num_consecutive, reason)
        else:
            logger.warning("%s will be restarted in %.1f s (restart %d in a row)",
                           handle.worker_id, decision.restart_at - time.monotonic(),
                           decision.num_consecutive)

    def _supervise_workers(self, now: float) -> None:
        """Start due restarts; a replacement that exited or never became ready is lost again."""
        for worker_id in self.supervisor.start_overdue(now):
            handle = self.workers[worker_id]
            if handle.proc is not None and handle.proc.is_alive():
                handle.proc.kill()
            self._on_worker_lost(handle, f"not ready after {self.cluster.ready_timeout_s:.0f} s")
        for handle in self.workers.values():
            if handle.alive or self.supervisor.state(handle.worker_id) is not WorkerState.STARTING:
                continue
            if handle.proc is not None and not handle.proc.is_alive():
                self._on_worker_lost(handle, f"restarted process exited ({handle.proc.exitcode})")
        for worker_id in self.supervisor.due(now):
            self._restart_worker(worker_id)

    def _restart_worker(self, worker_id: str) -> None:
        """Spawn a fresh process for a lost worker (same id and input socket). It stays out of
        routing until its `WorkerReady` and first report (`_maybe_readmit`)."""
        handle = self.workers[worker_id]
        handle.ready = handle.load = handle.last_report = None
        handle.counters = WorkerCounters()  # a new process counts from zero
        handle.request_ids.clear()
        handle.proc = self.launcher.process(handle.spec)
        self.supervisor.on_started(worker_id, time.monotonic())
        try:
            handle.proc.start()
        except OSError as exc:  # e.g. out of memory or pids: back off and try again
            handle.proc = None
            self._on_worker_lost(handle, f"could not spawn: {exc}")
            return
        logger.warning("restarting %s (pid %s)", worker_id, handle.proc.pid)

    def _on_worker_restart_ready(self, ready: WorkerReady) -> None:
        handle = self.workers.get(ready.worker_id)
        if handle is None or handle.alive or handle.proc is None or ready.pid != handle.proc.pid:
            return  # a stale announcement of a process already replaced
        other = self._other_weights(ready)
        if other is not None:  # never routed to: its KV would be wrong on every other worker
            logger.error("%s", other)
            if handle.proc.is_alive():
                handle.proc.kill()
            self._on_worker_lost(handle, other)
            return
        handle.ready = ready

    def _other_weights(self, ready: WorkerReady) -> str | None:
        """Why `ready`'s worker must not join (None if it may): KV computed with other weights
        looks like any other KV (same shapes), so a hand-off or a store block between such
        workers would be a silently wrong answer. E.g. a model path that holds other files
        on another machine (Ray)."""
        if not ready.weights_fingerprint:  # nothing to compare: it cannot be trusted with KV
            return (f"{ready.worker_id} reported no weights fingerprint (a build that does "
                    f"not say which files it loaded); its KV could not be checked")
        if not self.weights_fingerprint:
            self.weights_fingerprint = ready.weights_fingerprint
            return None
        if ready.weights_fingerprint == self.weights_fingerprint:
            return None
        return (f"{ready.worker_id} loaded other model files (weights fingerprint "
                f"{ready.weights_fingerprint[:12]}, the cluster's is "
                f"{self.weights_fingerprint[:12]}): check that --model names the same files on "
                f"every machine")

    def _maybe_readmit(self, handle: WorkerHandle) -> None:
        """A report from a restarted worker that announced itself: route to it again."""
        if handle.ready is None or \
                self.supervisor.state(handle.worker_id) is not WorkerState.STARTING:
            return
        now = time.monotonic()
        handle.alive, handle.dead_reason = True, None
        handle.last_seen = handle.last_loop_advance = now  # not the old process's liveness
        router = self.prefill_router if handle.role == "prefill" else self.decode_router
        router.add_worker(handle.worker_id)
        outage = self.supervisor.on_admitted(handle.worker_id, now)
        if outage is not None:
            logger.warning("%s is back in routing %.1f s after it was lost (%s)",
                           handle.worker_id, outage.recovery_s, outage.reason)
