"""The front's sockets to its worker processes, shared by the prefill/decode cluster
(`DisaggClient`) and the encode stage (`EncodeStage`):

    front ROUTER (one per worker) ◀─▶ DEALER worker DEALER ──▶ ROUTER (one, shared) front

and the clean stop of those processes. Both ROUTERs are bound; each worker connection proves
which worker it is first (`wire.hello`), and until then it is sent nothing and what it sends
is read only as a hello. So a stray peer on a worker's input port takes no share of its
work (a PULL cannot even pair with a ROUTER), and a report that names another worker than the
one its connection proved to be is dropped (`sender_mismatch`).

Reports stay on a shared output ROUTER rather than on each worker's input connection: one
loop reads every worker's reports (startup, the inbox), in arrival order across workers, as
before, and each input socket keeps its own queue and send timeout. A worker's DEALERs set an
explicit random routing id, so a connection ZMQ re-dials after a network cut is still the
bound one (ROUTER_HANDOVER is off: while it is connected, nobody else can take that id); a
restarted process is a new id and says hello again (`release` frees the old binding).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

import zmq
import zmq.asyncio

from deepinfer.wire import ChannelReceiver, channel_name, drops
from deepinfer.wire.hello import HEARTBEAT_SLOT, HelloGate

logger = logging.getLogger(__name__)

SEND_TIMEOUT_MS = 2000  # a worker's input socket that blocks this long is treated as lost
OUTPUT_SLOTS = ("", HEARTBEAT_SLOT)  # a worker's heartbeat thread has a connection of its own


def _bound_router(ctx: zmq.asyncio.Context, host: str) -> tuple[zmq.asyncio.Socket, str]:
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    # An unknown or disconnected peer raises (EHOSTUNREACH) instead of a silent drop; a full
    # pipe blocks at most this long (a dead worker must not block the front's loop).
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
    port = sock.bind_to_random_port(f"tcp://{host}")
    return sock, f"tcp://{host}:{port}"


async def _reply(sock: zmq.asyncio.Socket, rid: bytes, frame: bytes | None) -> None:
    if frame is not None:
        try:
            await sock.send_multipart([rid, frame], flags=zmq.NOBLOCK)
        except zmq.ZMQError:  # it went away meanwhile: it asks again if it is still there
            pass


class WorkerInput:
    """The front's bound ROUTER to one worker: answers hellos (a reader task on the running
    loop) and sends work only to the connection that proved to be `worker_id`."""

    def __init__(self, ctx: zmq.asyncio.Context, host: str, worker_id: str) -> None:
        self.worker_id = worker_id
        self.socket, self.address = _bound_router(ctx, host)
        self.gate = HelloGate(self.address, lambda wid: wid == worker_id)
        self._reader = asyncio.get_running_loop().create_task(
            self._read(), name=f"hello-{worker_id}")

    async def _read(self) -> None:
        while True:
            try:
                rid, *frames = await self.socket.recv_multipart()
            except zmq.ZMQError:  # closed
                return
            if self.gate.worker_of(rid) is not None:
                self.gate.drop(drops.INVALID, "the bound worker sent on its input")
                continue
            await _reply(self.socket, rid, self.gate.on_frame(rid, frames))

    @property
    def bound(self) -> bool:
        return self.gate.rid_of(self.worker_id) is not None

    async def send(self, frame, copy: bool = True, flags: int = 0) -> None:
        """Raises zmq.Again when the worker cannot take it: not (or no longer) connected,
        or its pipe full for SEND_TIMEOUT_MS."""
        rid = self.gate.rid_of(self.worker_id)
        if rid is None or self.socket.closed:
            raise zmq.Again()  # it has not said hello (or was released, or is shut down)
        try:
            await self.socket.send_multipart([rid, frame], copy=copy, flags=flags)
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                raise zmq.Again() from None  # its connection is gone
            raise

    def release(self) -> None:
        """Forget the bound connection: a restarted process says hello again."""
        self.gate.release(self.worker_id)

    def close(self, linger: int = 0) -> None:
        self._reader.cancel()
        self.socket.close(linger=linger)


class WorkerOutput:
    """The shared bound ROUTER every worker reports to: hellos from unproven connections,
    `message_type` messages from proven ones, each checked against its connection's worker.
    `expected(worker_id)`: whether that worker may report here."""

    def __init__(self, ctx: zmq.asyncio.Context, host: str, message_type,
                 expected: Callable[[str], bool]) -> None:
        self.socket, self.address = _bound_router(ctx, host)
        self.gate = HelloGate(self.address, expected, slots=OUTPUT_SLOTS)
        self.decoder = ChannelReceiver(channel_name("worker.output", self.address),
                                       message_type)

    async def poll(self, timeout_ms: int) -> bool:
        return bool(await self.socket.poll(timeout_ms))

    async def recv_message(self):
        """The next frame's message; None for one dropped (counted) or a hello."""
        rid, *frames = await self.socket.recv_multipart()
        worker_id = self.gate.worker_of(rid)
        if worker_id is None:
            await _reply(self.socket, rid, self.gate.on_frame(rid, frames))
            return None
        if len(frames) != 1:
            self.decoder.drop(drops.FRAMES, f"{len(frames)} parts")
            return None
        message = self.decoder.decode(frames[0])
        if message is not None and getattr(message, "worker_id", None) != worker_id:
            self.decoder.drop(drops.SENDER_MISMATCH, f"{getattr(message, 'worker_id', None)!r} "
                              f"on {worker_id}'s connection")
            return None
        return message

    async def receive(self, source: str):
        """`recv_message`, logging what it cannot read (one bad frame must not kill the loop
        that reads it)."""
        try:
            return await self.recv_message()
        except Exception as exc:  # CancelledError is not an Exception: cancellation works
            logger.exception("bad message from %s: %s", source, exc)
            return None

    def release(self, worker_id: str) -> None:
        self.gate.release(worker_id)

    def close(self, linger: int = 0) -> None:
        self.socket.close(linger=linger)


def bind_worker_input(ctx: zmq.asyncio.Context, host: str, worker_id: str) -> WorkerInput:
    """The ROUTER to one worker, bound on a free port (`.address`)."""
    return WorkerInput(ctx, host, worker_id)


def bind_worker_output(ctx: zmq.asyncio.Context, host: str, message_type,
                       expected: Callable[[str], bool]) -> WorkerOutput:
    """The ROUTER every worker reports to, bound on a free port (`.address`)."""
    return WorkerOutput(ctx, host, message_type, expected)


async def stop_worker_processes(workers: Iterable[tuple[object, WorkerInput, bytes]],
                                join_timeout_s: float = 10.0) -> None:
    """Send every live (process, input socket, its signed shutdown frame) the frame, wait
    for each, kill what is left and close the sockets."""
    workers = list(workers)
    for proc, sock, shutdown_frame in workers:
        if proc is not None and proc.is_alive():
            try:
                # Never blocks: a worker already gone is unreachable at once.
                await sock.send(shutdown_frame, flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
    for proc, sock, _ in workers:
        if proc is not None:
            await asyncio.to_thread(proc.join, join_timeout_s)
            if proc.is_alive():
                proc.kill()
        sock.close(linger=0)
