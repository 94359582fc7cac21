"""The worker side of the front's sockets for tests that play workers: DEALERs that say hello
(`wire.hello`) to a front's input ROUTER and to its output ROUTER, as a real worker process
does (cluster/process_shell.py)."""
from __future__ import annotations

import asyncio
import os

import zmq

from deepinfer.wire.hello import say_hello


def dealer(ctx: zmq.Context, addr: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, b"w" + os.urandom(15))
    sock.connect(addr)
    return sock


async def hello_dealer(ctx: zmq.Context, worker_id: str, addr: str,
                       timeout_s: float = 10.0) -> zmq.Socket:
    """A DEALER connected to `addr` that the front's ROUTER there has welcomed as `worker_id`
    (the hello runs in a thread: the front answers it on this event loop)."""
    sock = dealer(ctx, addr)
    try:
        await asyncio.to_thread(say_hello, sock, worker_id, addr, timeout_s, 0.5)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock
