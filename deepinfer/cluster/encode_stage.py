"""`EncodeStage`: the front's side of the encode workers (the E of E/P/D).

    DisaggClient.generate ─▶ EncodeStage.encode(request, mm_inputs)
                               │ encode router (least queued patches, reservations)
                               ▼
                     EncodeImages ─▶ encode worker ─EncodeDone (in its report)─▶ future

The stage owns its workers' processes and sockets (a channel apart from prefill/decode, so
its messages never wait behind KV handoffs). `encode` returns once every image's embeddings
are in the worker's cache and the shared store, so the prefill worker the request goes to
next can fetch them by image hash. A worker whose process exits is removed from routing and
its requests are sent once more to another encode worker; a request whose encoding fails
raises ValueError (the client gets a 400, nothing else is affected).
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import time
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from deepinfer.wire.encode_messages import (EncodeCounters, EncodeDone, EncodeImages,
                                               EncodeWorkerMessage, EncodeWorkerReady,
                                               EncodeWorkerReport)
from deepinfer.multimodal.encode_metrics import (ENCODE_TIME_BUCKETS, IMAGES_PER_REQUEST_BUCKETS,
                                              BucketCounts)
from deepinfer.cluster.encode_worker import EncodeWorkerSpec, run_encode_worker_proc
from deepinfer.wire.worker_messages import AbortRequests, ShutdownWorker, WorkerFailed
from deepinfer.cluster.worker_channels import (SEND_TIMEOUT_MS, WorkerInput, bind_worker_input,
                                               bind_worker_output, stop_worker_processes)
from deepinfer.cluster.worker_startup import await_workers_ready
from deepinfer.cluster.worker_supervisor import (RestartPolicy, WorkerState, WorkerSupervisor,
                                                 drive_restarts)
from deepinfer.wire.mm_inputs import MultiModalInputs
from deepinfer.routing import NoWorkerAvailable, WorkerLoad
from deepinfer.routing.encode_router import EncodeRequest, build_encode_router
from deepinfer.engine.exceptions import EngineDeadError
from deepinfer.wire import ChannelSender, channel_name

logger = logging.getLogger(__name__)
HEALTH_CHECK_PERIOD_S = 0.1


@dataclass(frozen=True)
class EncodeStageConfig:
    num_workers: int
    router: str = "least-patches"
    kv_store_url: str | None = None
    cache_bytes: int = 1 << 30
    max_batch_images: int = 8
    host: str = "127.0.0.1"
    ready_timeout_s: float = 600.0
    encode_timeout_s: float = 120.0
    report_interval_s: float = 0.2
    log_level: str = "WARNING"
    restart: RestartPolicy = field(default_factory=RestartPolicy)  # lost workers' restarts

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise ValueError("--encode-workers must be at least 1")
        if self.kv_store_url in (None, "none"):
            raise ValueError("--encode-workers needs a shared store (--kv-store fs or redis): "
                             "prefill workers fetch image embeddings from it")


@dataclass
class _EncodeWorker:
    spec: EncodeWorkerSpec
    socket: WorkerInput  # the front's ROUTER to it (sends only once it said hello)
    proc: multiprocessing.process.BaseProcess | None = None
    ready: bool = False
    alive: bool = True
    counters: EncodeCounters = field(default_factory=EncodeCounters)
    num_queued_images: int = 0
    num_queued_patches: int = 0
    request_ids: set[str] = field(default_factory=set)
    last_report_at: float = 0.0  # front's clock; 0 before the first report
    sender: ChannelSender = field(init=False)  # signs what the front sends it

    def __post_init__(self) -> None:
        self.sender = ChannelSender(channel_name("worker.input", self.spec.input_addr))

    @property
    def worker_id(self) -> str:
        return self.spec.worker_id


@dataclass
class _Pending:
    message: EncodeImages
    future: asyncio.Future
    worker_id: str
    num_tries: int = 1


class EncodeStage:
    def __init__(self, engine_config, config: EncodeStageConfig) -> None:
        self.engine_config = engine_config
        self.config = config
        self.router = build_encode_router(config.router)
        self.workers: dict[str, _EncodeWorker] = {}
        self._pending: dict[str, _Pending] = {}
        self._tasks: list[asyncio.Task] = []
        self._ctx = zmq.asyncio.Context()
        self._output = bind_worker_output(self._ctx, config.host, EncodeWorkerMessage,
                                          lambda worker_id: worker_id in self.workers)
        self._output_addr = self._output.address
        # Front-side observations (metrics): per-image encode time, images per request.
        self.encode_time = BucketCounts(ENCODE_TIME_BUCKETS)
        self.images_per_request = BucketCounts(IMAGES_PER_REQUEST_BUCKETS)
        self.num_requests = 0
        self.num_lost = 0
        self.supervisor = WorkerSupervisor(config.restart)  # restarts lost encode workers

    # --- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        c = self.config
        for i in range(c.num_workers):
            sock = bind_worker_input(self._ctx, c.host, f"encode-{i}")
            spec = EncodeWorkerSpec(
                worker_id=f"encode-{i}", engine_config=self.engine_config,
                input_addr=sock.address, output_addr=self._output_addr,
                parent_pid=os.getpid(), kv_store_url=c.kv_store_url, cache_bytes=c.cache_bytes,
                max_batch_images=c.max_batch_images, report_interval_s=c.report_interval_s,
                log_level=c.log_level)
            worker = _EncodeWorker(spec, sock)
            self.workers[spec.worker_id] = worker  # before it starts: it may say hello
            self._spawn(worker)
        await self._wait_ready()
        now = time.monotonic()
        for worker_id in self.workers:
            self.supervisor.add_worker(worker_id, "encode", now)
        self._tasks = [asyncio.create_task(self._output_loop(), name="encode-output-loop"),
                       asyncio.create_task(self._health_loop(), name="encode-health-loop")]

    def _spawn(self, worker: _EncodeWorker) -> None:
        ctx = multiprocessing.get_context("spawn")
        worker.proc = ctx.Process(target=run_encode_worker_proc, args=(worker.spec,),
                                  name=f"deepinfer-{worker.worker_id}", daemon=True)
        worker.proc.start()

    async def _wait_ready(self) -> None:
        await await_workers_ready(self._output, self.workers,
                                  self.config.ready_timeout_s, "encode workers",
                                  self._on_startup_message)

    async def _on_startup_message(self, message) -> str | None:
        if isinstance(message, EncodeWorkerReady):
            self.workers[message.worker_id].ready = True
            return message.worker_id
        if isinstance(message, EncodeWorkerReport):
            self._on_report(message)
        return None

    async def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        await stop_worker_processes((w.proc, w.socket, w.sender.encode(ShutdownWorker()))
                                    for w in self.workers.values())
        self._output.close(linger=0)
        self._ctx.term()

    @property
    def is_healthy(self) -> bool:
        return any(w.alive and w.ready for w in self.workers.values())

    # --- requests ----------------------------------------------------------------------------
    async def encode(self, request_id: str, mm_inputs: MultiModalInputs) -> EncodeDone:
        """Have an encode worker put every image of `mm_inputs` in the shared store. Raises
        ValueError if encoding failed, EngineDeadError if no encode worker is left."""
        if not mm_inputs.pixel_values:
            raise ValueError("images without pixel values cannot be encoded")
        # The vision tower's work is its output rows: each placeholder's length.
        message = EncodeImages(request_id, mm_inputs.image_hashes, list(mm_inputs.pixel_values),
                               num_patches=sum(p.length for p in mm_inputs.placeholders))
        self.images_per_request.observe(len(mm_inputs.placeholders))
        future = asyncio.get_running_loop().create_future()
        pending = _Pending(message, future, worker_id="")
        self._pending[request_id] = pending
        self.num_requests += 1
        try:
            await self._route(pending, exclude=None)
            done = await asyncio.wait_for(future, self.config.encode_timeout_s)
        except asyncio.TimeoutError:
            raise EngineDeadError(f"image encoding took longer than "
                                  f"{self.config.encode_timeout_s:.0f} s") from None
        finally:
            if self._pending.pop(request_id, None) is not None and not future.done():
                await self._abort(pending)  # client gone or timed out: drop queued work
            worker = self.workers.get(pending.worker_id)
            if worker is not None:
                worker.request_ids.discard(request_id)
        if done.error is not None:
            raise ValueError(done.error)
        num_encoded = done.num_images - done.num_local_hits - done.num_store_hits
        if num_encoded > 0:
            self.encode_time.observe(done.encode_s / num_encoded)
        return done

    async def _route(self, pending: _Pending, exclude: str | None) -> None:
        m = pending.message
        loads = [self._load(w) for w in self.workers.values()
                 if w.alive and w.ready and w.worker_id != exclude]
        try:
            worker_id = self.router.route(
                EncodeRequest(m.request_id, len(m.image_hashes), max(m.num_patches, len(m.image_hashes))),
                loads, time.monotonic())
        except NoWorkerAvailable as exc:
            raise EngineDeadError(f"no encode worker available: {exc}") from None
        pending.worker_id = worker_id
        self.workers[worker_id].request_ids.add(m.request_id)
        try:
            await self.workers[worker_id].socket.send(self.workers[worker_id].sender.encode(m),
                                                      copy=False)
        except zmq.Again:
            raise EngineDeadError(f"{worker_id} accepted nothing for {SEND_TIMEOUT_MS} ms") from None

    async def _abort(self, pending: _Pending) -> None:
        worker = self.workers.get(pending.worker_id)
        self.router.on_request_aborted(pending.message.request_id, pending.worker_id)
        if worker is not None and worker.alive:
            try:
                await worker.socket.send(worker.sender.encode(AbortRequests(
                    [pending.message.request_id])))
            except zmq.ZMQError:
                pass

    def _load(self, worker: _EncodeWorker, now: float | None = None) -> WorkerLoad:
        return WorkerLoad(worker.worker_id, "encode", worker.last_report_at if now is None else now,
                          num_waiting_reqs=worker.num_queued_images,
                          num_queued_uncached_tokens=worker.num_queued_patches,
                          healthy=worker.alive)

    # --- worker messages ---------------------------------------------------------------------
    async def _output_loop(self) -> None:
        while True:
            message = await self._output.receive("an encode worker")
            if isinstance(message, EncodeWorkerReport):
                self._on_report(message)
            elif isinstance(message, EncodeWorkerReady):
                self._on_restarted(message)
            elif isinstance(message, WorkerFailed):
                await self._on_worker_lost(message.worker_id, message.message.strip().splitlines()[-1])

    def _on_report(self, report: EncodeWorkerReport) -> None:
        worker = self.workers.get(report.worker_id)
        if worker is None or not worker.alive:
            return
        worker.counters = report.counters
        worker.num_queued_images = report.num_queued_images
        worker.num_queued_patches = report.num_queued_patches
        worker.last_report_at = time.monotonic()
        self.router.on_load_report(self._load(worker, worker.last_report_at))
        for done in report.done:
            pending = self._pending.get(done.request_id)
            if pending is not None and pending.worker_id == report.worker_id \
                    and not pending.future.done():
                pending.future.set_result(done)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_CHECK_PERIOD_S)
            await self._check_workers(time.monotonic())

    async def _check_workers(self, now: float) -> None:
        """Lose exited workers; start due restarts; a replacement that exited or never became
        ready is lost again (the supervisor's back-off and give-up decide what follows)."""
        for worker in list(self.workers.values()):
            if worker.alive and worker.proc is not None and not worker.proc.is_alive():
                await self._on_worker_lost(worker.worker_id,
                                           f"process exited ({worker.proc.exitcode})")
        drive_restarts(self.supervisor, now, lambda w: self.workers[w].proc,
                       lambda w, reason: self._on_lost_for_good(self.workers[w], reason),
                       lambda w: self._restart(w, now))

    def _restart(self, worker_id: str, now: float) -> None:
        worker = self.workers[worker_id]
        worker.ready, worker.counters = False, EncodeCounters()
        worker.socket.release()  # the new process proves itself again
        self._output.release(worker_id)
        self.supervisor.on_started(worker_id, now)
        try:
            self._spawn(worker)
        except OSError as exc:
            worker.proc = None
            self._on_lost_for_good(worker, f"could not spawn: {exc}")
            return
        logger.warning("restarting %s (pid %s)", worker_id, worker.proc.pid)

    def _on_lost_for_good(self, worker: _EncodeWorker, reason: str) -> None:
        decision = self.supervisor.on_lost(worker.worker_id, reason, time.monotonic())
        if decision.gave_up:
            logger.error("giving up on %s after %d restarts in a row (last loss: %s)",
                         worker.worker_id, decision.num_consecutive, reason)

    def _on_restarted(self, ready: EncodeWorkerReady) -> None:
        """A restarted worker loaded its tower: routable again."""
        worker = self.workers.get(ready.worker_id)
        if worker is None or worker.alive or worker.proc is None or ready.pid != worker.proc.pid \
                or self.supervisor.state(worker.worker_id) is not WorkerState.STARTING:
            return  # a stale announcement of a process already replaced
        worker.alive = worker.ready = True
        worker.num_queued_images = worker.num_queued_patches = 0
        self.router.add_worker(worker.worker_id)
        self.supervisor.on_admitted(worker.worker_id, time.monotonic())
        logger.warning("%s is back in routing", worker.worker_id)

    async def _on_worker_lost(self, worker_id: str, reason: str) -> None:
        """Out of routing for good; its requests go once more to another encode worker."""
        worker = self.workers.get(worker_id)
        if worker is None or not worker.alive:
            return
        logger.error("%s removed from routing: %s", worker_id, reason)
        worker.alive = False
        self.num_lost += 1
        self.router.remove_worker(worker_id)
        if worker.proc is not None and worker.proc.is_alive():
            worker.proc.kill()
        for request_id in sorted(worker.request_ids):
            pending = self._pending.get(request_id)
            if pending is None or pending.future.done():
                continue
            if pending.num_tries < 2:
                pending.num_tries += 1
                try:
                    await self._route(pending, exclude=worker_id)
                    continue
                except EngineDeadError as exc:
                    reason = f"{reason}; retry impossible: {exc}"
            pending.future.set_exception(EngineDeadError(f"encode worker {worker_id} was lost ({reason})"))
        worker.request_ids.clear()
        self._on_lost_for_good(worker, reason)

