"""The one shape of every worker process: the colocated engine process, prefill / decode /
encode workers and expert-parallel ranks.

    open its two channels (input PULL from the front, output PUSH to it)
    build what it serves (an injected builder: engine, loop, transports)
    announce it (the builder's ready message)
    run its loop until Shutdown or the front is gone
    on any error: report death (a message the front turns into 5xx, suspension or restart)
    always: close what the builder opened, then the sockets

Workers connect to the front; nothing here binds, so no stray peer can take a share of work.
"""
from __future__ import annotations

import logging
import signal
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from deepinfer.wire import ChannelSender, channel_name

logger = logging.getLogger(__name__)

DEATH_MESSAGE_CHARS = 4000  # the traceback's tail: enough to read, bounded on the wire


@dataclass
class Serving:
    """What a builder hands back: the message that announces the process, its loop, and what
    to close when it ends (beyond the two sockets)."""

    ready: object
    run: Callable[[], None]
    closers: list[Callable[[], None]] = field(default_factory=list)


def open_worker_process(worker_id: str, log_level: str, input_addr: str, output_addr: str):
    """A worker process's common start: SIGINT left to the front (which shuts workers down;
    a Ray actor runs the loop in a thread, where signals cannot be set), logging tagged with
    the worker id, and its two sockets -> (context, input PULL, output PUSH)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(),
                        format=f"%(asctime)s %(levelname)s {worker_id}: %(message)s")
    ctx = zmq.Context()
    input_socket = ctx.socket(zmq.PULL)
    input_socket.connect(input_addr)
    output_socket = ctx.socket(zmq.PUSH)
    output_socket.setsockopt(zmq.SNDHWM, 0)  # unbounded: never block the loop on the front
    output_socket.setsockopt(zmq.LINGER, 2000)
    output_socket.connect(output_addr)
    return ctx, input_socket, output_socket


def run_process(name: str, log_level: str, input_addr: str, output_addr: str,
                output_channel: str, build: Callable[..., Serving],
                death: Callable[[str], object]) -> None:
    """Run one worker process of the shape above. `build(ctx, input_socket, output_socket)`
    returns its `Serving`; `death(message)` is the message that reports a failure (the
    traceback's tail). Exits with SystemExit(1) after reporting a failure."""
    ctx, input_socket, output_socket = open_worker_process(name, log_level, input_addr,
                                                           output_addr)
    encoder = ChannelSender(channel_name(output_channel, output_addr))
    serving = None
    try:
        serving = build(ctx, input_socket, output_socket)
        output_socket.send(encoder.encode(serving.ready))
        serving.run()
    except Exception:  # report, then die: the front decides what a lost worker means
        message = traceback.format_exc()
        logger.error("%s failed:\n%s", name, message)
        output_socket.send(encoder.encode(death(message[-DEATH_MESSAGE_CHARS:])))
        raise SystemExit(1)
    finally:
        for close in (serving.closers if serving is not None else ()):
            close()
        input_socket.close(linger=0)
        output_socket.close()
        ctx.term()
