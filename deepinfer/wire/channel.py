"""Typed, authenticated channels: a msgspec message in, a signed frame out, and back.

    sender = ChannelSender("worker.input@" + addr)            # front side
    sock.send(sender.encode(PrefillRequest(...)))
    receiver = ChannelReceiver("worker.input@" + addr, ClusterInput)  # worker side
    message = receiver.decode(sock.recv())                     # None: dropped and counted

A receiver decodes only into its channel's message union (msgspec validates every field's
type), so a frame of another channel's type is dropped even when correctly signed. `decode`
never raises on a bad frame: it counts it (`drops.PROCESS_DROPS`), logs it at a rate limit,
and returns None, so the loop that read it keeps running.
"""
from __future__ import annotations

from collections.abc import Sequence

import msgspec

from deepinfer.wire import drops
from deepinfer.wire.frame import (DEFAULT_MAX_FRAME_BYTES, FrameDropped, FrameSigner,
                                  FrameVerifier)


class ChannelSender:
    """Encodes and signs messages for one channel (one per sending socket and thread)."""

    def __init__(self, channel: str, key: bytes | None = None) -> None:
        self.channel = channel
        self._signer = FrameSigner(channel, key)
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, message, attached: Sequence = ()) -> bytes:
        return self._signer.sign(self._encoder.encode(message), attached)

    def sign(self, payload: bytes) -> bytes:
        """The frame of an already encoded message (one encoding, several channels)."""
        return self._signer.sign(payload)


class ChannelReceiver:
    """Verifies and decodes frames of one channel into `message_type` (a Struct or a union
    of tagged Structs)."""

    def __init__(self, channel: str, message_type, key: bytes | None = None,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
                 counter: drops.DropCounter | None = None) -> None:
        self.channel = channel
        self._verifier = FrameVerifier(channel, key, max_frame_bytes)
        self._decoder = msgspec.msgpack.Decoder(message_type)
        self.counter = counter if counter is not None else drops.PROCESS_DROPS

    def decode(self, frame, attached: Sequence = ()):
        """The message, or None when the frame was dropped (counted and logged)."""
        try:
            return self.decode_or_raise(frame, attached)
        except FrameDropped as exc:
            self.drop(exc.reason, exc.detail)
            return None

    def decode_or_raise(self, frame, attached: Sequence = ()):
        payload = self._verifier.verify(frame, attached)
        try:
            return self._decoder.decode(payload)
        except msgspec.ValidationError as exc:  # valid msgpack, not this channel's message
            raise FrameDropped(drops.TYPE, str(exc)[:200]) from None
        except (msgspec.DecodeError, ValueError, TypeError, RecursionError) as exc:
            raise FrameDropped(drops.DECODE, str(exc)[:200]) from None

    def drop(self, reason: str, detail: str = "") -> None:
        """Count a frame dropped for a reason found by the caller (e.g. wrong part count)."""
        self.counter.record(self.channel, reason, detail)


def channel_name(kind: str, endpoint: str) -> str:
    """"kind@endpoint": both ends of a channel must build the same name."""
    return f"{kind}@{endpoint}"
