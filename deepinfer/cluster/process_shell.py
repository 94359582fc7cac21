"""The one shape of every worker process: the colocated engine process, prefill / decode /
encode workers and expert-parallel ranks.

    open its two channels (input from the front, output to it; cluster workers say hello on both)
    build what it serves (an injected builder: engine, loop, transports)
    announce it (the builder's ready message)
    run its loop until Shutdown or the front is gone
    on any error: report death (a message the front turns into 5xx, suspension or restart)
    always: close what the builder opened, then the sockets

Workers connect to the front; nothing here binds. A cluster worker (prefill, decode, encode,
an EP decode rank) connects DEALERs to the front's ROUTERs and proves on each which worker it
is (`wire.hello`) before it builds anything, so the front sends work only to it and believes
only its reports (cluster/worker_channels.py). The colocated engine process and the ranks of
a colocated EP group keep PULL/PUSH on ipc sockets in a 0700 directory (docs/security.md).
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from deepinfer.wire import ChannelSender, channel_name
from deepinfer.wire.hello import say_hello

logger = logging.getLogger(__name__)

DEATH_MESSAGE_CHARS = 4000  # the traceback's tail: enough to read, bounded on the wire
HELLO_TIMEOUT_S = 120.0  # the front answers at once; a Ray placement may start us early


@dataclass
class Serving:
    """What a builder hands back: the message that announces the process, its loop, and what
    to close when it ends (beyond the two sockets)."""

    ready: object
    run: Callable[[], None]
    closers: list[Callable[[], None]] = field(default_factory=list)


def open_worker_process(worker_id: str, log_level: str, input_addr: str, output_addr: str,
                        hello: bool = False):
    """A worker process's common start: SIGINT left to the front (which shuts workers down;
    a Ray actor runs the loop in a thread, where signals cannot be set), logging tagged with
    the worker id, and its two sockets -> (context, input, output). `hello`: DEALERs that
    prove themselves to the front's ROUTERs (cluster workers); else PULL / PUSH."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(),
                        format=f"%(asctime)s %(levelname)s {worker_id}: %(message)s")
    ctx = zmq.Context()
    input_socket = ctx.socket(zmq.DEALER if hello else zmq.PULL)
    output_socket = ctx.socket(zmq.DEALER if hello else zmq.PUSH)
    output_socket.setsockopt(zmq.SNDHWM, 0)  # unbounded: never block the loop on the front
    output_socket.setsockopt(zmq.LINGER, 2000)
    if hello:
        for sock in (input_socket, output_socket):
            set_routing_id(sock)
    try:
        input_socket.connect(input_addr)
        if hello:
            say_hello(input_socket, worker_id, input_addr, HELLO_TIMEOUT_S)
        output_socket.connect(output_addr)
        if hello:
            say_hello(output_socket, worker_id, output_addr, HELLO_TIMEOUT_S)
    except BaseException:
        input_socket.close(linger=0)
        output_socket.close(linger=0)
        ctx.term()
        raise
    return ctx, input_socket, output_socket


def set_routing_id(sock: zmq.Socket) -> None:
    """A random routing id of this connection's own, kept across ZMQ's re-dials: a connection
    re-dialled after a network cut is still the one bound to this worker."""
    sock.setsockopt(zmq.ROUTING_ID, b"w" + os.urandom(15))  # ids starting 0x00 are ZMQ's


def run_process(name: str, log_level: str, input_addr: str, output_addr: str,
                output_channel: str, build: Callable[..., Serving],
                death: Callable[[str], object], hello: bool = False) -> None:
    """Run one worker process of the shape above. `build(ctx, input_socket, output_socket)`
    returns its `Serving`; `death(message)` is the message that reports a failure (the
    traceback's tail). Exits with SystemExit(1) after reporting a failure. `hello`: `name`
    is the worker id it proves to the front (see `open_worker_process`)."""
    ctx, input_socket, output_socket = open_worker_process(name, log_level, input_addr,
                                                           output_addr, hello)
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
