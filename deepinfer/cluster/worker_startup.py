"""Waiting for spawned worker processes to report ready (prefill/decode and encode workers)."""
from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from deepinfer.wire.worker_messages import WorkerFailed
from deepinfer.engine.exceptions import EngineDeadError


async def await_workers_ready(output, workers: Mapping[str, Any], timeout_s: float,
                              label: str,
                              on_message: Callable[[object], Awaitable[str | None]]) -> None:
    """Receive from `output` (a worker_channels.WorkerOutput) until every worker in `workers` (each with a `.proc`) is ready.

    `on_message` handles every other message and returns the id of the worker it marks ready
    (None if it marks none). A worker that exits or reports `WorkerFailed` first, or the
    deadline, raises EngineDeadError."""
    deadline = time.monotonic() + timeout_s
    pending = set(workers)
    while pending:
        if time.monotonic() > deadline:
            raise EngineDeadError(f"{label} not ready after {timeout_s:.0f} s: {sorted(pending)}")
        if not await output.poll(500):
            for wid in pending:
                proc = workers[wid].proc
                if not proc.is_alive():
                    raise EngineDeadError(f"{wid} exited with code {proc.exitcode}")
            continue
        message = await output.recv_message()  # None: a hello, or dropped
        if isinstance(message, WorkerFailed):
            raise EngineDeadError(f"{message.worker_id} failed to start:\n{message.message}")
        ready = await on_message(message)
        if ready is not None:
            pending.discard(ready)
