"""Async client of one engine process, used by the API front (asyncio + zmq.asyncio).

Each request gets an `asyncio.Queue` of `RequestDelta`s filled by one background task that
reads the engine's output socket; `generate()` yields from it and aborts the request in the
engine if the caller stops early (client disconnect, error, cancellation).
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import pickle
import shutil
import tempfile
import time
from collections.abc import AsyncIterator

import zmq
import zmq.asyncio

from deepinfer.sampling_params import SamplingParams
from deepinfer.server.engine_proc import run_engine_proc
from deepinfer.server.messages import (
    AbortRequest, AddRequest, EngineDead, EngineOutputs, EngineReady, EngineStatsSnapshot,
    RequestDelta, Shutdown, make_encoder, make_engine_decoder,
)

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine process died; no request can be served."""


class _RequestFailed:
    """Queue item telling `generate()` to raise (engine rejected the request or died)."""

    def __init__(self, error: Exception) -> None:
        self.error = error


class EngineClient:
    """Starts the engine process and multiplexes requests over its sockets."""

    def __init__(self, engine_config, *, ready_timeout_s: float = 600.0,
                 log_level: str = "WARNING") -> None:
        self.engine_config = engine_config
        self.ready_timeout_s = ready_timeout_s
        self.log_level = log_level
        self.model_name = ""
        self.max_model_len = 0
        self.vocab_size = 0
        self.tokenizer = None
        self.stats = EngineStatsSnapshot()
        self.dead_message: str | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._num_requests_sent = 0
        self._encoder = make_encoder()
        self._decoder = make_engine_decoder()
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._output_task: asyncio.Task | None = None
        self._ipc_dir = tempfile.mkdtemp(prefix="deepinfer-ipc-")
        self._ctx = zmq.asyncio.Context()
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)
        self._input.bind(f"ipc://{self._ipc_dir}/input")
        self._output = self._ctx.socket(zmq.PULL)
        self._output.setsockopt(zmq.RCVHWM, 0)
        self._output.bind(f"ipc://{self._ipc_dir}/output")

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Spawn the engine process and wait until it has loaded the model."""
        ctx = multiprocessing.get_context("spawn")
        self._proc = ctx.Process(
            target=run_engine_proc, name="deepinfer-engine", daemon=True,
            args=(self.engine_config, f"ipc://{self._ipc_dir}/input",
                  f"ipc://{self._ipc_dir}/output", os.getpid(), self.log_level))
        self._proc.start()
        ready = await self._wait_ready()
        self.model_name = ready.model_name
        self.max_model_len = ready.max_model_len
        self.vocab_size = ready.vocab_size
        self.tokenizer = pickle.loads(ready.tokenizer_pickle)
        self._output_task = asyncio.create_task(self._output_loop(), name="engine-output-loop")

    async def _wait_ready(self) -> EngineReady:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if await self._output.poll(500):
                message = self._decoder.decode(await self._output.recv())
                if isinstance(message, EngineReady):
                    return message
                if isinstance(message, EngineDead):
                    raise EngineDeadError(f"engine failed to start:\n{message.message}")
            elif not self._proc.is_alive():
                raise EngineDeadError(f"engine process exited with code {self._proc.exitcode}")
        raise EngineDeadError(f"engine not ready after {self.ready_timeout_s:.0f} s")

    async def shutdown(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            await self._input.send(self._encoder.encode(Shutdown()))
            await asyncio.to_thread(self._proc.join, 10)
            if self._proc.is_alive():
                self._proc.terminate()
        if self._output_task is not None:
            self._output_task.cancel()
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)

    @property
    def is_healthy(self) -> bool:
        return (self.dead_message is None and self._proc is not None and self._proc.is_alive())

    @property
    def num_waiting_requests(self) -> int:
        """Requests queued in the engine plus those sent but not yet seen by it."""
        in_flight = self._num_requests_sent - self.stats.num_requests_received
        return max(0, in_flight) + self.stats.num_waiting

    # --- requests ----------------------------------------------------------------------------

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, arrival_time: float | None = None,
                       ) -> AsyncIterator[RequestDelta]:
        """Yield the request's deltas until it finishes. Raises ValueError if the engine rejects
        the request, EngineDeadError if the engine dies. Aborts in the engine on early exit."""
        if not self.is_healthy:
            raise EngineDeadError(self.dead_message or "engine is not running")
        if request_id in self._queues:
            raise ValueError(f"duplicate request id {request_id!r}")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        finished = False
        try:
            self._num_requests_sent += 1  # before the await: a concurrent 429 check sees it
            logger.debug("add %s", request_id)
            await self._send(AddRequest(request_id, list(prompt_token_ids), params,
                                        arrival_time or time.monotonic()))
            while not finished:
                item = await queue.get()
                if isinstance(item, _RequestFailed):
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
        await self._send(AbortRequest(list(request_ids)))

    async def _send(self, message) -> None:
        await self._input.send(self._encoder.encode(message), copy=False)

    async def _output_loop(self) -> None:
        while True:
            try:
                if not await self._output.poll(1000):
                    if not self._proc.is_alive():
                        self._fail_all(f"engine process exited ({self._proc.exitcode})")
                        return
                    continue
                message = self._decoder.decode(await self._output.recv())
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a corrupt frame must not kill the front
                logger.exception("bad message from engine: %s", e)
                continue
            if isinstance(message, EngineOutputs):
                self._dispatch(message)
            elif isinstance(message, EngineDead):
                self._fail_all(message.message)
                return

    def _dispatch(self, message: EngineOutputs) -> None:
        if message.stats is not None:
            self.stats = message.stats
        for delta in message.outputs:
            queue = self._queues.get(delta.request_id)
            if queue is not None:  # absent: the caller already left and aborted
                queue.put_nowait(delta)
        for error in message.errors:
            queue = self._queues.get(error.request_id)
            if queue is not None:
                queue.put_nowait(_RequestFailed(ValueError(error.message)))

    def _fail_all(self, message: str) -> None:
        logger.error("engine died: %s", message)
        self.dead_message = message
        for queue in self._queues.values():
            queue.put_nowait(_RequestFailed(EngineDeadError(message)))
