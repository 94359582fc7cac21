"""The front's sockets to its worker processes, shared by the prefill/decode cluster
(`DisaggClient`) and the encode stage (`EncodeStage`):

    front PUSH (one per worker) ──▶ worker        worker ──▶ PULL (one, shared) front

and the clean stop of those processes.
"""
from __future__ import annotations

import asyncio
from collections.abc import Iterable

import zmq
import zmq.asyncio

SEND_TIMEOUT_MS = 2000  # a worker's input socket that blocks this long is treated as lost


def bind_worker_input(ctx: zmq.asyncio.Context, host: str) -> tuple[zmq.asyncio.Socket, str]:
    """A PUSH socket to one worker, bound on a free port -> (socket, address)."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    # A PUSH socket whose worker died has no peer and would block a send forever, and with
    # it the front's output loop (so every worker would look silent).
    sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
    port = sock.bind_to_random_port(f"tcp://{host}")
    return sock, f"tcp://{host}:{port}"


def bind_worker_output(ctx: zmq.asyncio.Context, host: str) -> tuple[zmq.asyncio.Socket, str]:
    """The PULL socket every worker reports to, bound on a free port -> (socket, address)."""
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, 0)
    port = sock.bind_to_random_port(f"tcp://{host}")
    return sock, f"tcp://{host}:{port}"


async def stop_worker_processes(workers: Iterable[tuple[object, zmq.asyncio.Socket, bytes]],
                                join_timeout_s: float = 10.0) -> None:
    """Send every live (process, input socket, its signed shutdown frame) the frame, wait
    for each, kill what is left and close the sockets."""
    workers = list(workers)
    for proc, sock, shutdown_frame in workers:
        if proc is not None and proc.is_alive():
            try:
                # Never blocks: a PUSH whose worker already went has no peer to queue for.
                await sock.send(shutdown_frame, flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
    for proc, sock, _ in workers:
        if proc is not None:
            await asyncio.to_thread(proc.join, join_timeout_s)
            if proc.is_alive():
                proc.kill()
        sock.close(linger=0)
