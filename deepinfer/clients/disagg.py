"""`DisaggClient`: the front door's client of a disaggregated cluster.

    generate ─▶ prefill router ─PrefillRequest─▶ prefill worker ─first token─▶ client
                                                      │ PrefillDone
               decode router ◀────────────────────────┘
                    └─DecodeRequest─▶ decode worker ─pulls KV─▶ ... ─tokens─▶ client

Three parts, one per file: this one (lifecycle and the request flow), `disagg_inbox`
(everything workers send, dispatched to requests, routers and health) and `disagg_health`
(suspension, loss, retries and restarts of workers).

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

import zmq
import zmq.asyncio

from deepinfer.clients.disagg_health import WorkerHealth
from deepinfer.clients.disagg_inbox import WorkerInbox
from deepinfer.clients.disagg_track import _Track
from deepinfer.clients.request_stream import StreamFailed, check_new_stream
from deepinfer.cluster.cluster_config import ClusterConfig
from deepinfer.cluster.cluster_metrics import spec_decode_totals
from deepinfer.cluster.launcher import LocalLauncher, WorkerLauncher
from deepinfer.wire.worker_messages import (AbortRequests, DebugHangLoop, DecodeRequest,
                                        PrefillDone, PrefillRequest, ShutdownWorker,
                                        WorkerLoadReport, WorkerMessage, WorkerReady,
                                        WorkerReport)
from deepinfer.cluster.worker_channels import (SEND_TIMEOUT_MS, bind_worker_input,
                                               bind_worker_output, stop_worker_processes)
from deepinfer.cluster.worker_handle import WorkerHandle
from deepinfer.cluster.worker_spec import WorkerSpec
from deepinfer.cluster.worker_startup import await_workers_ready
from deepinfer.cluster.worker_supervisor import WorkerSupervisor
from deepinfer.core.prefix_hash import hash_request_blocks
from deepinfer.engine.exceptions import EngineDeadError
from deepinfer.wire.mm_inputs import MultiModalInputs
from deepinfer.routing import (NoWorkerAvailable, RequestTooLarge, RoutingRequest,
                               build_decode_router, build_prefill_router)
from deepinfer.sampling_params import SamplingParams
from deepinfer.wire.engine_messages import EngineStatsSnapshot, RequestDelta
from deepinfer.wire import tokenizer_from_files
from deepinfer.wire.drops import sum_reports

logger = logging.getLogger(__name__)
MAX_PLACEMENTS = 4096  # recent request -> workers history kept for metrics and debugging


class DisaggClient:
    supports_prompt_logprobs = False  # workers do not forward them

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
        # request id -> [prefill worker, decode worker] of recent requests (bounded).
        self.placements: OrderedDict[str, list[str | None]] = OrderedDict()
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
        self._output = bind_worker_output(self._ctx, cluster.host, self._worker_message_type(),
                                          lambda worker_id: worker_id in self.workers)
        self._output_addr = self._output.address
        self.inbox = WorkerInbox(self)
        self.health = WorkerHealth(self)

    def _worker_message_type(self):
        """What workers may send on the shared output channel (a subclass adds its own)."""
        return WorkerMessage

    def _on_other_message(self, message) -> None:
        """A message a subclass added to the worker protocol (`_worker_message_type`), e.g.
        the EPLB results of an expert-parallel decode group."""

    # --- lifecycle ---------------------------------------------------------------------------
    def _make_handle(self, role: str, index: int) -> WorkerHandle:
        c = self.cluster
        worker_id = f"{role}-{index}"
        sock = bind_worker_input(self._ctx, c.host, worker_id)
        self._output.release(worker_id)  # a new handle: a new process says hello
        spec = WorkerSpec(
            worker_id=worker_id, role=role, engine_config=self.engine_config,
            input_addr=sock.address, output_addr=self._output_addr,
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
        self._tasks = [asyncio.create_task(self.inbox.run(), name="cluster-output-loop"),
                       asyncio.create_task(self.health.run(), name="cluster-health-loop")]

    async def _wait_ready(self) -> None:
        await await_workers_ready(self._output, self.workers,
                                  self.cluster.ready_timeout_s, "workers", self._on_startup_message)

    async def _on_startup_message(self, message) -> str | None:
        if isinstance(message, WorkerReady):
            other = self.health.other_weights(message)
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
            await self.inbox.on_report(message)
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
            from deepinfer.multimodal.encode_metrics import EncodeCollector
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
        """Yield the request's deltas until it finishes; see `ColocatedClient.generate`.
        `mm_inputs`: the prompt's images; with encode workers they are encoded there first
        and the prefill worker gets only the placeholders (it fetches the embeddings)."""
        if not self.is_healthy:
            raise EngineDeadError(self.dead_message or "the cluster has no live prefill or "
                                  "decode worker")
        if params.n != 1:
            raise ValueError("disaggregated serving supports n=1 only")
        check_new_stream(self._requests, request_id)
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
                if isinstance(item, StreamFailed):
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
        track.queue.put_nowait(StreamFailed(error))
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
        except zmq.Again:  # gone, or its pipe full for SEND_TIMEOUT_MS
            # Not awaited here: worker-loss handling sends to other workers and fails requests.
            self._tasks.append(asyncio.get_running_loop().create_task(self.health.on_worker_dead(
                worker_id, f"its input socket accepted nothing for {SEND_TIMEOUT_MS} ms")))

    def router_of(self, role: str):
        """The router that places requests on `role` workers."""
        return self.prefill_router if role == "prefill" else self.decode_router

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
