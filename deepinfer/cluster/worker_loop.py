"""`WorkerLoop`: what prefill and decode workers share — sockets, inputs, reports, heartbeats.

    front PUSH ──ClusterInput──▶ PULL  worker loop  PUSH ──WorkerReport──▶ PULL front

The loop drains its input between steps without waiting, steps the engine while it has
work, and sends one `WorkerReport` (outputs, errors, handoffs, load, counters) after every
step that produced something, on every input, and at least every `report_interval_s` (the
heartbeat). Idle, it blocks on the input socket for at most the report interval.
"""
from __future__ import annotations

import logging
import os
import time

import zmq

from deepinfer.wire.worker_messages import (AbortRequests, DebugHangLoop, PrefillDone,
                                        ShutdownWorker,
                                        WorkerCounters, WorkerLoadReport, WorkerReport,
                                        ClusterInput)
from deepinfer.cluster.worker_spec import WorkerSpec
from deepinfer.cluster.engine_proc import OutputDeltaTracker
from deepinfer.wire.engine_messages import RequestDelta, RequestError
from deepinfer.wire.inbox import drain_messages
from deepinfer.wire import PROCESS_DROPS, ChannelReceiver, ChannelSender, channel_name

logger = logging.getLogger(__name__)


class WorkerLoop:
    role = "worker"

    def __init__(self, spec: WorkerSpec, engine, input_socket: zmq.Socket,
                 output_socket: zmq.Socket) -> None:
        self.spec = spec
        self.engine = engine
        self.input_socket = input_socket
        self.output_socket = output_socket
        self.tracker = OutputDeltaTracker()
        self.counters = WorkerCounters()
        self.encoder = ChannelSender(channel_name("worker.output", spec.output_addr))
        self.decoder = ChannelReceiver(channel_name("worker.input", spec.input_addr),
                                       ClusterInput)
        self._outputs: list[RequestDelta] = []
        self._errors: list[RequestError] = []
        self._prefill_done: list[PrefillDone] = []
        self._kv_received: list[str] = []
        self._dirty = True
        self._last_report = 0.0
        self.last_iteration_time = time.monotonic()  # read by the heartbeat thread

    # --- hooks -------------------------------------------------------------------------------
    def handle(self, message) -> None:
        raise NotImplementedError

    def before_step(self) -> None:
        """Work between steps that is not an input (e.g. finished transfers)."""

    def has_step_work(self) -> bool:
        return self.engine.has_unfinished_requests()

    def has_background_work(self) -> bool:
        """Work that needs polling but not a step (e.g. transfers in flight)."""
        return False

    def after_step(self, outputs: list) -> None:
        self.answer_step_failures()
        for output in outputs:
            self._outputs.append(self.tracker.to_delta(output))

    def forget_failed(self, request_id: str) -> None:
        """The engine dropped this request (a failed step): free what the role holds for it."""

    def answer_step_failures(self) -> None:
        """Requests the engine failed (it carried on without them: `isolate_step_faults`, or
        e.g. images a decode worker cannot recompute) are forgotten here and answered with
        their error, which the front turns into a request failure (500 request_failed)."""
        for failure in self.engine.take_request_failures():
            self.forget_failed(failure.request_id)
            self.tracker.forget([failure.request_id])
            self._errors.append(RequestError(failure.request_id, failure.message, failed=True,
                                             engine_fault=failure.engine_fault))
            self._dirty = True

    def extra_load(self) -> tuple[int, int, int]:
        """(waiting requests, KV tokens, queued uncached tokens) held outside the scheduler's
        queues."""
        return 0, 0, 0

    def staging_load(self) -> tuple[int, int]:
        """(KV staging bytes used, capacity) of a prefill worker; (0, 0) otherwise."""
        return 0, 0

    def update_counters(self) -> None:
        """Refresh cumulative counters before a report."""

    def store_load_rate(self) -> float | None:
        """A prefill worker's measured seconds to load one token's KV from the store."""
        return None

    def compute_load_rate(self) -> float | None:
        """A prefill worker's measured prefill seconds per computed token."""
        return None

    # --- loop --------------------------------------------------------------------------------
    def run(self) -> None:
        while True:
            busy = self.has_step_work()
            timeout_ms = 0 if busy else (5 if self.has_background_work()
                                         else int(self.spec.report_interval_s * 1000))
            wait_start = time.perf_counter()
            if not self._drain_inputs(timeout_ms):
                return
            if timeout_ms:
                self.counters.idle_wait_seconds_total += time.perf_counter() - wait_start
            self.before_step()
            step_start = None
            if self.has_step_work():
                step_start = time.perf_counter()
                cpu_start = time.process_time()
                outputs = self.engine.step()
                self.counters.model_step_cpu_seconds_total += time.process_time() - cpu_start
                self.counters.num_engine_steps += 1
                self.counters.model_step_seconds_total += self.engine.get_stats().step_time_s
                self.after_step(outputs)
                self._dirty = self._dirty or bool(outputs)
            if self._dirty or time.monotonic() - self._last_report >= self.spec.report_interval_s:
                self.send_report()
            if step_start is not None:
                self.counters.loop_step_seconds_total += time.perf_counter() - step_start
            self.last_iteration_time = time.monotonic()
            if self.spec.parent_pid is not None and os.getppid() != self.spec.parent_pid:
                logger.warning("front process is gone; %s exiting", self.spec.worker_id)
                return

    def _drain_inputs(self, timeout_ms: int) -> bool:
        return drain_messages(self.input_socket, self.decoder.decode, timeout_ms, self._on_message)

    def _on_message(self, message) -> bool:
        if isinstance(message, ShutdownWorker):
            return False
        self._dirty = True
        if isinstance(message, DebugHangLoop):
            self._hang(message)
            return True
        if isinstance(message, AbortRequests):
            self.engine.abort_request(message.request_ids)
            self.tracker.forget(message.request_ids)
        self.handle(message)
        return True

    def _hang(self, message: DebugHangLoop) -> None:
        """Fault injection: a loop that stops advancing while the process lives."""
        logger.warning("%s: engine loop hung on request (until %s exists)",
                       self.spec.worker_id, message.release_path)
        deadline = time.monotonic() + message.max_s
        while not os.path.exists(message.release_path) and time.monotonic() < deadline:
            time.sleep(0.05)

    # --- reports -----------------------------------------------------------------------------
    def emit_error(self, request_id: str, message: str, param: str | None = None) -> None:
        self._errors.append(RequestError(request_id, message, param=param))
        self._dirty = True

    def emit_prefill_done(self, done: PrefillDone) -> None:
        self._prefill_done.append(done)
        self._dirty = True

    def load_report(self) -> WorkerLoadReport:
        sched = self.engine.scheduler
        kv = sched.kv
        extra_waiting, extra_kv_tokens, extra_queued = self.extra_load()
        staged_bytes, staging_capacity = self.staging_load()
        queued = extra_queued + sum(r.num_tokens - r.num_computed_tokens for r in sched.waiting)
        queued += sum(r.num_tokens - r.num_computed_tokens - 1 for r in sched.running
                      if r.num_tokens - r.num_computed_tokens > 1)
        return WorkerLoadReport(
            num_running_reqs=sched.num_running,
            num_waiting_reqs=sched.num_waiting + extra_waiting,
            num_queued_uncached_tokens=queued,
            num_kv_blocks_used=kv.pool.num_used_blocks,
            num_kv_blocks_total=kv.num_blocks,
            block_size=kv.block_size,
            kv_tokens=sum(r.num_tokens for r in sched.running) + extra_kv_tokens,
            max_running_reqs=sched.config.max_num_seqs, kv_staged_bytes=staged_bytes,
            kv_staging_capacity_bytes=staging_capacity,
            store_load_s_per_token=self.store_load_rate(),
            compute_s_per_token=self.compute_load_rate())

    def send_report(self) -> None:
        self.counters.num_failed_steps = self.engine.num_failed_steps
        self.counters.num_failed_requests = self.engine.num_failed_requests
        self.counters.process_cpu_seconds = time.process_time()
        self.counters.wire_frames_dropped = PROCESS_DROPS.as_report()
        self.update_counters()
        report = WorkerReport(worker_id=self.spec.worker_id, load=self.load_report(),
                              counters=self.counters, outputs=self._outputs,
                              errors=self._errors, prefill_done=self._prefill_done,
                              kv_received=self._kv_received)
        self.output_socket.send(self.encoder.encode(report), copy=False)
        self._outputs, self._errors, self._prefill_done, self._kv_received = [], [], [], []
        self._dirty = False
        self._last_report = time.monotonic()
