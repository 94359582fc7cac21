"""The signed frames of the KV pull channel (decode DEALER -> prefill ROUTER and back).

    decode ──[ sign(KVPull) ]──────────────────────────▶ prefill   "kv.pull@<kv addr>"
    decode ◀──[ sign(KVPullReply, covers payload), payload ]── prefill  "kv.reply@<kv addr>"

The payload's MAC is computed over the raw bytes in place (no copy); its size must match the
header's shape and dtype before a tensor is made of it. A bad pull or reply is dropped and
counted, never raised into the transport's threads.
"""
from __future__ import annotations

import math
import warnings

import torch

from deepinfer.wire.worker_messages import KVPull, KVPullReply
from deepinfer.kvstore.tensor_codec import _torch_dtype
from deepinfer.wire import ChannelReceiver, ChannelSender, FrameDropped, channel_name
from deepinfer.wire import drops

MAX_PULL_FRAME_BYTES = 4096  # a request id, signed
MAX_REPLY_FRAME_BYTES = 1 << 40  # KV payloads are as large as prompts make them
MAX_KV_DIMS = 8


def pull_sender(kv_addr: str) -> ChannelSender:
    return ChannelSender(channel_name("kv.pull", kv_addr))


def pull_receiver(kv_addr: str) -> ChannelReceiver:
    return ChannelReceiver(channel_name("kv.pull", kv_addr), KVPull,
                           max_frame_bytes=MAX_PULL_FRAME_BYTES)


def reply_sender(kv_addr: str) -> ChannelSender:
    return ChannelSender(channel_name("kv.reply", kv_addr))


def reply_receiver(kv_addr: str) -> ChannelReceiver:
    return ChannelReceiver(channel_name("kv.reply", kv_addr), KVPullReply,
                           max_frame_bytes=MAX_REPLY_FRAME_BYTES)


def read_pull(receiver: ChannelReceiver, frames: list) -> tuple[bytes, KVPull] | None:
    """(peer identity, pull) from a ROUTER's multipart message; None: dropped."""
    if len(frames) != 2:
        receiver.drop(drops.FRAMES, f"{len(frames)} parts")
        return None
    pull = receiver.decode(frames[1])
    return None if pull is None else (frames[0], pull)


def read_reply(receiver: ChannelReceiver, frames: list
               ) -> tuple[KVPullReply, torch.Tensor | None] | None:
    """(header, KV tensor or None when the reply is a refusal) from a DEALER's multipart
    message of zmq.Frames; None: dropped."""
    if len(frames) not in (1, 2):
        receiver.drop(drops.FRAMES, f"{len(frames)} parts")
        return None
    payload = [frames[1].buffer] if len(frames) == 2 else []
    reply = receiver.decode(frames[0].buffer, payload)
    if reply is None:
        return None
    if not reply.ok or not payload:
        return reply, None
    try:
        return reply, _payload_tensor(reply, payload[0])
    except FrameDropped as exc:
        receiver.drop(exc.reason, exc.detail)
        return None


def _payload_tensor(reply: KVPullReply, buffer) -> torch.Tensor:
    try:
        dtype = _torch_dtype(reply.dtype)
    except ValueError as exc:
        raise FrameDropped(drops.INVALID, str(exc)) from None
    if len(reply.shape) > MAX_KV_DIMS or any(d < 0 for d in reply.shape):
        raise FrameDropped(drops.INVALID, f"shape {reply.shape[:MAX_KV_DIMS + 1]}")
    num_bytes = math.prod(reply.shape) * dtype.itemsize
    if num_bytes != memoryview(buffer).nbytes:
        raise FrameDropped(drops.INVALID, f"{memoryview(buffer).nbytes} bytes for "
                                          f"{reply.shape} {reply.dtype}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only frame buffer; we only read it
        raw = torch.frombuffer(buffer, dtype=torch.uint8) if num_bytes else \
            torch.empty(0, dtype=torch.uint8)
    return raw.view(dtype).reshape(reply.shape)
