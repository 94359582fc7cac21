"""`ColocatedClient`: the front's client of one engine process (asyncio + zmq.asyncio).

Each request gets an `asyncio.Queue` of `RequestDelta`s filled by one background task that
reads the engine's output socket; `generate()` yields from it and aborts the request in the
engine if the caller stops early (client disconnect, error, cancellation).

When the engine process dies, every request in flight fails at once with `EngineDeadError`
and the client is unhealthy until `EngineSupervisor` (engine_supervisor.py) has started a new
engine and seen its first report. Each engine incarnation gets fresh sockets, so nothing
queued for a dead engine can reach its successor.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator

import msgspec
import zmq
import zmq.asyncio

from deepinfer.clients.engine_supervisor import EngineRestartPolicy, EngineSupervisor
from deepinfer.clients.request_stream import StreamFailed, check_new_stream, engine_error
from deepinfer.engine.exceptions import EngineDeadError, exit_message
from deepinfer.sampling_params import SamplingParams
from deepinfer.cluster.engine_proc import run_engine_proc
from deepinfer.wire.engine_messages import (
    AbortRequest, AddRequest, EngineDead, EngineOutputs, EngineReady, EngineStatsSnapshot,
    EngineMessage, RequestDelta, Shutdown,
)
from deepinfer.wire.inbox import receive_message
from deepinfer.wire import ChannelReceiver, ChannelSender, channel_name, tokenizer_from_files
from deepinfer.wire.drops import sum_reports

logger = logging.getLogger(__name__)


DEFAULT_LOOP_STALL_TIMEOUT_S = 30.0  # above the longest step (steps are budgeted in time)


class ColocatedClient:
    """Starts the engine process, multiplexes requests over its sockets, and (with a restart
    policy) restarts it when it dies."""

    supports_prompt_logprobs = True  # its engine process forwards them (engine_proc)

    def __init__(self, engine_config, *, ready_timeout_s: float = 600.0,
                 log_level: str = "WARNING",
                 restart_policy: EngineRestartPolicy | None = None,
                 loop_stall_timeout_s: float | None = DEFAULT_LOOP_STALL_TIMEOUT_S) -> None:
        self.engine_config = engine_config
        # The engine reports after every step and at least once a second when idle, so a
        # silence this long (process alive) is a hung step or a stopped process: it is killed
        # and, with a restart policy, restarted. None: never.
        self.loop_stall_timeout_s = loop_stall_timeout_s
        self._last_report = 0.0  # monotonic time of the engine's last message
        self.ready_timeout_s = ready_timeout_s
        self.log_level = log_level
        self.model_name = ""
        self.max_model_len = 0
        self.vocab_size = 0
        self.tokenizer = None
        self.dead_message: str | None = "engine not started"
        self.num_restarts = 0  # engines started after the first one died
        self._stats = EngineStatsSnapshot()
        self._stats_base = EngineStatsSnapshot()  # counters of engines that died
        self._queues: dict[str, asyncio.Queue] = {}
        self._num_requests_sent = 0  # to the current engine
        self._encoder: ChannelSender | None = None  # per engine incarnation (its endpoints)
        self._decoder: ChannelReceiver | None = None
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._output_task: asyncio.Task | None = None
        self._incarnation = 0
        self._dead_event: asyncio.Event | None = None
        self._supervisor = EngineSupervisor(self, restart_policy or EngineRestartPolicy(0))
        self._ipc_dir = tempfile.mkdtemp(prefix="deepinfer-ipc-")
        self._ctx = zmq.asyncio.Context()
        self._input: zmq.asyncio.Socket | None = None
        self._output: zmq.asyncio.Socket | None = None

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Spawn the engine process and wait until it has loaded the model."""
        self._dead_event = asyncio.Event()
        await self._start_engine()
        self._supervisor.start()

    async def restart_engine(self) -> None:
        """Start a new engine after the last one died (the supervisor calls this)."""
        await self._start_engine()
        self.num_restarts += 1

    async def wait_dead(self) -> None:
        """Wait until the current engine dies (the supervisor keeps its own uptime clock)."""
        await self._dead_event.wait()

    async def _start_engine(self) -> None:
        """Fresh sockets, a new process, its EngineReady and first report; then healthy.
        Raises EngineDeadError (the new process cleaned up) if it does not come up."""
        self._incarnation += 1
        name = f"ipc://{self._ipc_dir}/%s-{self._incarnation}"
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)
        self._input.bind(name % "input")
        self._output = self._ctx.socket(zmq.PULL)
        self._output.setsockopt(zmq.RCVHWM, 0)
        self._output.bind(name % "output")
        # Before the spawn: creating them exports the cluster secret the engine inherits.
        self._encoder = ChannelSender(channel_name("engine.input", name % "input"))
        self._decoder = ChannelReceiver(channel_name("engine.output", name % "output"),
                                        EngineMessage)
        ctx = multiprocessing.get_context("spawn")
        self._proc = ctx.Process(
            target=run_engine_proc, name="deepinfer-engine", daemon=True,
            args=(self.engine_config, name % "input", name % "output", os.getpid(),
                  self.log_level))
        self._proc.start()
        try:
            ready = await self._wait_ready()
            first_report = await self._wait_first_report()
        except BaseException:
            await self._reap(self._proc, self._input, self._output)
            raise
        self.model_name = ready.model_name
        self.max_model_len = ready.max_model_len
        self.vocab_size = ready.vocab_size
        self.tokenizer = self.tokenizer or tokenizer_from_files(ready.tokenizer_files)
        self._stats_base = _add_counters(self._stats_base, self._stats)
        self._stats = first_report.stats or EngineStatsSnapshot()
        self._num_requests_sent = 0
        self._dead_event.clear()
        self._last_report = time.monotonic()
        self.dead_message = None  # re-admit traffic
        self._output_task = asyncio.create_task(
            self._output_loop(self._proc, self._input, self._output),
            name=f"engine-output-loop-{self._incarnation}")

    async def _recv_until(self, kind, what: str):
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if await self._output.poll(500):
                message = self._decoder.decode(await self._output.recv())  # None: dropped
                if isinstance(message, kind):
                    return message
                if isinstance(message, EngineDead):
                    raise EngineDeadError(f"engine failed to start:\n{message.message}")
            elif not self._proc.is_alive():
                raise EngineDeadError(f"engine process exited with code {self._proc.exitcode}")
        raise EngineDeadError(f"engine {what} after {self.ready_timeout_s:.0f} s")

    async def _wait_ready(self) -> EngineReady:
        return await self._recv_until(EngineReady, "not ready")

    async def _wait_first_report(self) -> EngineOutputs:
        """The loop's first message: proof that it runs, not only that the model loaded."""
        return await self._recv_until(EngineOutputs, "sent no report")

    async def shutdown(self) -> None:
        await self._supervisor.stop()
        if self._proc is not None and self._proc.is_alive():
            try:
                await self._input.send(self._encoder.encode(Shutdown()), flags=zmq.NOBLOCK)
                await asyncio.to_thread(self._proc.join, 10)
            except zmq.ZMQError:
                pass
        if self._output_task is not None:
            self._output_task.cancel()
            await asyncio.gather(self._output_task, return_exceptions=True)
        await self._reap(self._proc, self._input, self._output)
        self._ctx.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)

    @staticmethod
    async def _reap(proc, *sockets) -> None:
        """Make sure `proc` is gone and close its sockets (dropping anything queued)."""
        if proc is not None:
            if proc.is_alive():
                proc.kill()
            await asyncio.to_thread(proc.join, 10)
        for sock in sockets:
            if sock is not None and not sock.closed:
                sock.close(linger=0)

    @property
    def is_healthy(self) -> bool:
        return (self.dead_message is None and self._proc is not None and self._proc.is_alive()
                and (self.loop_stall_timeout_s is None
                     or self.loop_age_s <= self.loop_stall_timeout_s))

    @property
    def loop_age_s(self) -> float:
        """Seconds since the engine's last report (its loop reports every iteration)."""
        return time.monotonic() - self._last_report

    @property
    def supervisor(self) -> EngineSupervisor:
        return self._supervisor

    @property
    def stats(self) -> EngineStatsSnapshot:
        """The current engine's gauges; counters summed over every engine incarnation."""
        return _add_counters(self._stats_base, self._stats)

    @property
    def num_waiting_requests(self) -> int:
        """Requests queued in the engine plus those sent but not yet seen by it."""
        in_flight = self._num_requests_sent - self._stats.num_requests_received
        return max(0, in_flight) + self._stats.num_waiting

    def register_metrics(self, registry) -> None:
        """`deepinfer:engine_restarts_total` on the server's Prometheus registry."""
        from deepinfer.clients.restart_metrics import EngineRestartsCollector
        registry.register(EngineRestartsCollector(lambda: self.num_restarts, self.model_name))

    # --- requests ----------------------------------------------------------------------------

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, arrival_time: float | None = None,
                       mm_inputs=None) -> AsyncIterator[RequestDelta]:
        """Yield the request's deltas until it finishes. Raises ValueError if the engine rejects
        the request, EngineDeadError if the engine dies. Aborts in the engine on early exit."""
        if not self.is_healthy:
            raise EngineDeadError(self.dead_message or "engine is not running")
        check_new_stream(self._queues, request_id)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        finished = False
        try:
            logger.debug("add %s", request_id)
            try:
                frame = self._encoder.encode(AddRequest(request_id, list(prompt_token_ids),
                                                        params, arrival_time or time.monotonic(),
                                                        mm_inputs=mm_inputs))
            except (OverflowError, TypeError) as e:  # a value the wire cannot carry
                finished = True
                raise ValueError(f"invalid request parameters: {e}") from None
            self._num_requests_sent += 1  # before the await: a concurrent 429 check sees it
            await self._send_frame(frame)
            while not finished:
                item = await queue.get()
                if isinstance(item, StreamFailed):
                    finished = True  # the engine holds no state for it
                    raise item.error
                finished = item.finished
                yield item
        finally:
            self._queues.pop(request_id, None)
            if not finished and self.is_healthy:
                logger.debug("abort %s", request_id)
                await self.abort([request_id])

    async def abort(self, request_ids: list[str]) -> None:
        try:
            await self._send(AbortRequest(list(request_ids)))
        except EngineDeadError:
            pass  # a dead engine holds no state to free

    async def _send(self, message) -> None:
        await self._send_frame(self._encoder.encode(message))

    async def _send_frame(self, frame: bytes) -> None:
        """Never blocks (unbounded queue): no engine connected means it is gone."""
        try:
            await self._input.send(frame, copy=False, flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:
            raise EngineDeadError(f"engine is not reachable ({e})") from None

    async def _output_loop(self, proc, input_socket, output_socket) -> None:
        """Dispatch one engine's outputs until it dies (or the client shuts down)."""
        while True:
            if not await output_socket.poll(500):
                if not proc.is_alive():
                    await self._on_engine_dead(proc, input_socket, output_socket,
                                               f"the engine process "
                                               f"{exit_message(proc.exitcode)}")
                    return
                if self.loop_stall_timeout_s is not None and \
                        self.loop_age_s > self.loop_stall_timeout_s:
                    await self._on_engine_dead(
                        proc, input_socket, output_socket,
                        f"the engine loop did not advance for {self.loop_age_s:.0f} s (a hung "
                        f"step or a stopped process); it was killed")
                    return
                continue
            self._last_report = time.monotonic()
            message = await receive_message(output_socket, self._decoder.decode, "engine")
            if isinstance(message, EngineOutputs):
                self._dispatch(message)
            elif isinstance(message, EngineDead):
                await self._on_engine_dead(proc, input_socket, output_socket,
                                           f"the engine failed: {message.message}")
                return

    def _dispatch(self, message: EngineOutputs) -> None:
        if message.stats is not None:
            self._stats = message.stats
        for delta in message.outputs:
            queue = self._queues.get(delta.request_id)
            if queue is not None:  # absent: the caller already left and aborted
                queue.put_nowait(delta)
        for error in message.errors:
            queue = self._queues.get(error.request_id)
            if queue is not None:
                queue.put_nowait(StreamFailed(engine_error(error)))

    async def _on_engine_dead(self, proc, input_socket, output_socket, message: str) -> None:
        if self._supervisor.policy.max_restarts > 0:
            message += "; the server is restarting it"
        self._fail_all(message)
        await self._reap(proc, input_socket, output_socket)
        self._dead_event.set()

    def _fail_all(self, message: str) -> None:
        """Unhealthy from now on; every request in flight fails with `message`."""
        logger.error("engine died: %s", message)
        self.dead_message = message
        for queue in self._queues.values():
            queue.put_nowait(StreamFailed(EngineDeadError(message)))


_COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions",
             "num_failed_steps", "num_failed_requests",
             "prediction_abs_error_sum", "num_predicted_steps", "spec_decode_num_drafts",
             "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


def _add_counters(base: EngineStatsSnapshot, current: EngineStatsSnapshot
                  ) -> EngineStatsSnapshot:
    """`current` with the cumulative counters of `base` added (Prometheus counters must not
    go back to 0 when the engine is restarted)."""
    per_pos = [a + b for a, b in itertools.zip_longest(
        base.spec_decode_num_accepted_tokens_per_pos,
        current.spec_decode_num_accepted_tokens_per_pos, fillvalue=0)]
    drops = sum_reports((base.wire_frames_dropped, current.wire_frames_dropped))
    return msgspec.structs.replace(current, spec_decode_num_accepted_tokens_per_pos=per_pos,
                                   wire_frames_dropped=drops, **{
        name: getattr(base, name) + getattr(current, name) for name in _COUNTERS})
