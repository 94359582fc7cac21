"""Draining a ZMQ input socket between engine steps (engine process and cluster workers)."""
from __future__ import annotations

from collections.abc import Callable

import zmq


def drain_messages(socket: zmq.Socket, decode: Callable[[bytes], object], timeout_ms: int,
                   handle: Callable[[object], bool]) -> bool:
    """Wait up to `timeout_ms` for a frame, then decode and handle every queued message
    without blocking. `handle` returns False to stop (a shutdown message); so does this."""
    if not socket.poll(timeout_ms):
        return True
    while True:
        try:
            frame = socket.recv(zmq.NOBLOCK)
        except zmq.Again:
            return True
        if not handle(decode(frame)):
            return False
