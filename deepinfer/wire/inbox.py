"""Draining a ZMQ input socket between engine steps (engine process and cluster workers), and
the front's receive of one message from its engine or workers."""
from __future__ import annotations

import logging
from collections.abc import Callable

import zmq

logger = logging.getLogger(__name__)


def drain_messages(socket: zmq.Socket, decode: Callable[[bytes], object], timeout_ms: int,
                   handle: Callable[[object], bool]) -> bool:
    """Wait up to `timeout_ms` for a frame, then decode and handle every queued message
    without blocking. `handle` returns False to stop (a shutdown message); so does this.
    `decode` returns None for a frame it dropped (wire.ChannelReceiver); that is skipped."""
    if not socket.poll(timeout_ms):
        return True
    while True:
        try:
            frame = socket.recv(zmq.NOBLOCK)
        except zmq.Again:
            return True
        message = decode(frame)
        if message is not None and not handle(message):
            return False


async def receive_message(socket, decode: Callable[[bytes], object], source: str) -> object | None:
    """The next message on an asyncio socket; None for a frame that was dropped (counted by a
    wire.ChannelReceiver) or does not decode (logged): one bad frame must not kill the
    front's output loop."""
    try:
        return decode(await socket.recv())
    except Exception as exc:  # CancelledError is not an Exception: cancellation still works
        logger.exception("bad message from %s: %s", source, exc)
        return None
