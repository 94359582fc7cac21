"""Authenticated frames: what every message between DeepInfer processes travels in.

    +---------+--------+-----------+----------+----------------+-------------------+
    | version | key id | sender id | sequence |      MAC       |      payload      |
    |  1 B    |  4 B   |    8 B    | 8 B (BE) |     32 B       |  msgpack message  |
    +---------+--------+-----------+----------+----------------+-------------------+

MAC = HMAC-SHA256(key, header fields | channel name | payload | attached parts). The channel
name (a kind plus the endpoint, "worker.input@tcp://10.0.0.2:5100") is not sent; both ends
know it, so a frame recorded on one channel is rejected on every other. Each `FrameSigner`
draws a random sender id and numbers its frames 1, 2, ...; a `FrameVerifier` accepts from a
sender only a sequence above the last one it accepted from it (ZMQ keeps one sender's frames
in order on one connection), so a recorded frame cannot be replayed. Attached parts (the raw
KV payload that follows a header frame) are covered by the same MAC without being copied.

HMAC-SHA256 over ZMQ CURVE: it works on every transport (ipc, tcp, inproc) and through Ray
without a key exchange or a ZAP handler thread, binds a frame to its channel, and costs one
pass of SHA-256 over the bytes (GB/s) -- the frames here are control messages except the KV
payloads. It authenticates; it does not encrypt (run multi-host traffic on a private network
or under a VPN / IPsec when prompts must stay confidential).
"""
from __future__ import annotations

import hashlib
import hmac
import itertools
import os
import struct
import threading
from collections import OrderedDict
from collections.abc import Sequence

from deepinfer.wire import drops
from deepinfer.wire.secret import cluster_key, key_id

VERSION = 1
_HEAD = struct.Struct(">B4s8sQ")  # version, key id, sender id, sequence
MAC_BYTES = 32
HEADER_BYTES = _HEAD.size + MAC_BYTES
DEFAULT_MAX_FRAME_BYTES = 256 << 20
MAX_TRACKED_SENDERS = 4096  # only authentic senders are tracked; a bound all the same


class FrameDropped(Exception):
    """A frame failed verification; `reason` is one of the `drops` reasons."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


def _mac(key: bytes, head: bytes, channel: bytes, payload, attached: Sequence) -> bytes:
    mac = hmac.new(key, digestmod=hashlib.sha256)
    mac.update(head)
    mac.update(struct.pack(">H", len(channel)))
    mac.update(channel)
    mac.update(struct.pack(">Q", len(payload)))
    mac.update(payload)
    for part in attached:  # length-prefixed: parts cannot be re-split without detection
        mac.update(struct.pack(">Q", memoryview(part).nbytes))
        mac.update(part)
    return mac.digest()


class FrameSigner:
    """Signs the frames one sender puts on one channel. Use one per socket (and thread): a
    receiver rejects a sender's frames that arrive out of order."""

    def __init__(self, channel: str, key: bytes | None = None) -> None:
        self.channel = channel
        self._channel = channel.encode("utf-8")
        self._key = key if key is not None else cluster_key()
        self._key_id = key_id(self._key)
        self._sender = os.urandom(8)
        self._sequence = itertools.count(1)  # next() is atomic under the GIL
        self._lock = threading.Lock()

    def sign(self, payload: bytes, attached: Sequence = ()) -> bytes:
        """The frame carrying `payload`; `attached` parts (sent as their own ZMQ frames after
        it) are covered by its MAC."""
        with self._lock:  # sequence order = the order frames are handed to the socket
            head = _HEAD.pack(VERSION, self._key_id, self._sender, next(self._sequence))
        return b"".join((head, _mac(self._key, head, self._channel, payload, attached),
                         payload))


class FrameVerifier:
    """Checks the frames one receiver reads from one channel; see the module docstring."""

    def __init__(self, channel: str, key: bytes | None = None,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self.channel = channel
        self._channel = channel.encode("utf-8")
        self._key = key if key is not None else cluster_key()
        self._key_id = key_id(self._key)
        self.max_frame_bytes = max_frame_bytes
        self._last_sequence: OrderedDict[bytes, int] = OrderedDict()
        self._lock = threading.Lock()

    def verify(self, frame, attached: Sequence = ()) -> memoryview:
        """The payload of an authentic, fresh frame; raises FrameDropped otherwise."""
        view = memoryview(frame)
        size = view.nbytes + sum(memoryview(p).nbytes for p in attached)
        if size > self.max_frame_bytes:
            raise FrameDropped(drops.OVERSIZE, f"{size} bytes > {self.max_frame_bytes}")
        if view.nbytes < HEADER_BYTES:
            raise FrameDropped(drops.TRUNCATED, f"{view.nbytes} bytes")
        version, kid, sender, sequence = _HEAD.unpack_from(view)
        if version != VERSION:
            raise FrameDropped(drops.VERSION, f"version {version}")
        if kid != self._key_id:
            raise FrameDropped(drops.KEY)
        head = view[:_HEAD.size]
        payload = view[HEADER_BYTES:]
        expected = _mac(self._key, head, self._channel, payload, attached)
        if not hmac.compare_digest(expected, view[_HEAD.size:HEADER_BYTES]):
            raise FrameDropped(drops.MAC)
        self._accept_sequence(sender, sequence)
        return payload

    def _accept_sequence(self, sender: bytes, sequence: int) -> None:
        with self._lock:
            last = self._last_sequence.get(sender, 0)
            if sequence <= last:
                raise FrameDropped(drops.REPLAY, f"sequence {sequence} <= {last}")
            self._last_sequence[sender] = sequence
            self._last_sequence.move_to_end(sender)
            while len(self._last_sequence) > MAX_TRACKED_SENDERS:
                self._last_sequence.popitem(last=False)
