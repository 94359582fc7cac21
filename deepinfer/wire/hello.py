"""The worker hello: a connection to a front ROUTER socket proves which worker it is before
the front sends it anything or believes what it sends.

    worker DEALER                                   front ROUTER (bound)
      HelloRequest(worker_id)      ── signed ──▶    a fresh random nonce for this connection
                                   ◀── signed ──    Challenge(nonce)
      Hello(worker_id, nonce)      ── signed ──▶    worker_id expected here, nonce the one
                                                    issued to this connection, worker not
                                                    bound to another connection
                                   ◀── signed ──    Welcome(): the connection is that worker's

Frames travel on two channels of the socket's endpoint, "worker.hello@addr" (worker to
front) and "worker.challenge@addr" (front to worker), so a hello cannot be reflected. The
nonce is what stops a recorded Hello from being replayed from another connection: it was
issued to the connection that asked, once, and is spent by the first answer. `HelloGate` is
the front's bookkeeping, without sockets: frames in, (routing id, reply) out; every frame it
refuses is counted through `drops` (channel "worker.hello").

What it proves: the peer holds the cluster secret and answered on this connection now. What
it does not: frames are still not encrypted, and the routing id of a bound connection is sent
in the clear in ZMQ's greeting (an on-path observer, who can read every frame anyway, could
take the id over after cutting the worker's connection).
"""
from __future__ import annotations

import hmac
import os
import time
from collections import OrderedDict
from collections.abc import Callable

import msgspec

from deepinfer.wire import drops
from deepinfer.wire.channel import ChannelReceiver, ChannelSender, channel_name

NONCE_BYTES = 16
MAX_PENDING = 256  # connections that asked and have not answered; a bound all the same
HEARTBEAT_SLOT = "heartbeat"  # the slot of a worker's heartbeat thread's own report socket


class HelloRequest(msgspec.Struct, tag=True):
    worker_id: str
    slot: str = ""  # which of the worker's connections to this socket (see HelloGate)


class Hello(msgspec.Struct, tag=True):
    worker_id: str
    nonce: bytes
    slot: str = ""


class Challenge(msgspec.Struct, tag=True):
    nonce: bytes


class Welcome(msgspec.Struct, tag=True):
    worker_id: str


WorkerHello = HelloRequest | Hello  # worker -> front
FrontHello = Challenge | Welcome  # front -> worker


def hello_channel(endpoint: str) -> str:
    return channel_name("worker.hello", endpoint)


def challenge_channel(endpoint: str) -> str:
    return channel_name("worker.challenge", endpoint)


class HelloGate:
    """Which connections (ZMQ routing ids) of one bound socket are which worker.

    `expected(worker_id)` says whether that worker may bind here (the one worker of an input
    socket; any worker of the client on the shared output socket). A worker binds one
    connection per slot it may use here (`slots`: e.g. its reports and its heartbeat thread's
    own socket), one at a time; `release(worker_id)` frees them for a new process (a restart).
    """

    def __init__(self, endpoint: str, expected: Callable[[str], bool],
                 key: bytes | None = None, counter: drops.DropCounter | None = None,
                 slots: tuple[str, ...] = ("",)) -> None:
        self.endpoint = endpoint
        self.expected = expected
        self.slots = slots
        self._receiver = ChannelReceiver(hello_channel(endpoint), WorkerHello, key,
                                         max_frame_bytes=4096, counter=counter)
        self._sender = ChannelSender(challenge_channel(endpoint), key)
        # routing id -> (nonce, the worker id and slot it was issued for)
        self._pending: OrderedDict[bytes, tuple[bytes, str, str]] = OrderedDict()
        self._worker_of: dict[bytes, str] = {}  # routing id -> worker id
        self._rid_of: dict[tuple[str, str], bytes] = {}  # (worker id, slot) -> routing id

    @property
    def counter(self) -> drops.DropCounter:
        return self._receiver.counter

    def worker_of(self, rid: bytes) -> str | None:
        return self._worker_of.get(rid)

    def rid_of(self, worker_id: str, slot: str = "") -> bytes | None:
        return self._rid_of.get((worker_id, slot))

    def release(self, worker_id: str) -> None:
        for slot in self.slots:
            rid = self._rid_of.pop((worker_id, slot), None)
            if rid is not None:
                self._worker_of.pop(rid, None)

    def drop(self, reason: str, detail: str = "") -> None:
        self._receiver.drop(reason, detail)

    def on_frame(self, rid: bytes, frames: list) -> bytes | None:
        """A message from a connection that is bound to no worker -> the reply frame to
        send back to `rid`, or None (dropped and counted, or nothing to say)."""
        if len(frames) != 1:
            self.drop(drops.FRAMES, f"{len(frames)} parts")
            return None
        message = self._receiver.decode(frames[0])
        if message is None:
            return None
        if not self.expected(message.worker_id) or message.slot not in self.slots:
            self.drop(drops.HELLO, f"{message.worker_id!r} ({message.slot!r}) does not "
                      "belong here")
            return None
        bound = self._rid_of.get((message.worker_id, message.slot))
        if bound is not None and bound != rid:
            self.drop(drops.HELLO, f"{message.worker_id} is bound to another connection")
            return None
        if isinstance(message, HelloRequest):
            # One nonce per connection until spent: a repeated ask (the worker retries while
            # the challenge is in flight) must not void the answer already on its way.
            asked = (message.worker_id, message.slot)
            pending = self._pending.get(rid)
            nonce = pending[0] if pending is not None and pending[1:] == asked \
                else os.urandom(NONCE_BYTES)
            self._pending[rid] = (nonce, *asked)
            self._pending.move_to_end(rid)
            while len(self._pending) > MAX_PENDING:
                self._pending.popitem(last=False)
            return self._sender.encode(Challenge(nonce))
        issued = self._pending.get(rid)
        if issued is None or issued[1:] != (message.worker_id, message.slot) \
                or not hmac.compare_digest(issued[0], message.nonce):
            self.drop(drops.HELLO, f"{message.worker_id}: not the nonce issued to it")
            return None
        del self._pending[rid]  # spent
        self._worker_of[rid] = message.worker_id
        self._rid_of[(message.worker_id, message.slot)] = rid
        return self._sender.encode(Welcome(message.worker_id))


class HelloRefused(RuntimeError):
    """The front never welcomed this connection (wrong secret, or not the worker it expects)."""


def say_hello(sock, worker_id: str, endpoint: str, timeout_s: float = 60.0,
              retry_s: float = 1.0, key: bytes | None = None, slot: str = "") -> None:
    """The worker's side on a connected DEALER (a blocking zmq.Socket): ask, answer the
    challenge, wait for the welcome. Asks again every `retry_s` until a challenge comes (the
    front may not be reading yet); raises HelloRefused after `timeout_s`."""
    sender = ChannelSender(hello_channel(endpoint), key)
    receiver = ChannelReceiver(challenge_channel(endpoint), FrontHello, key,
                               max_frame_bytes=4096)
    deadline = time.monotonic() + timeout_s
    next_ask = 0.0
    answered = None
    while True:
        now = time.monotonic()
        if now > deadline:
            raise HelloRefused(f"{worker_id}: no welcome from {endpoint} in {timeout_s:.0f} s")
        if now >= next_ask:
            sock.send(sender.encode(HelloRequest(worker_id, slot)))
            next_ask = now + retry_s
        if not sock.poll(max(1, int((min(next_ask, deadline) - now) * 1000))):
            continue
        message = receiver.decode(sock.recv())
        if isinstance(message, Challenge) and message.nonce != answered:  # once per nonce
            sock.send(sender.encode(Hello(worker_id, message.nonce, slot)))
            answered = message.nonce
            # The front reads us: no more asks (one arriving after the welcome would be a
            # frame on a bound connection, dropped and counted as a bad report).
            next_ask = deadline
        elif isinstance(message, Welcome) and message.worker_id == worker_id:
            return
