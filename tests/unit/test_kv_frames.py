"""The KV pull channel's frames: a reply's payload must be authentic and agree with its
signed shape and dtype before a tensor is made of it; wrong part counts are dropped."""
from __future__ import annotations

import torch

from deepinfer.cluster import kv_frames
from deepinfer.wire.worker_messages import KVPull, KVPullReply
from deepinfer.wire.drops import DropCounter

ADDR = "tcp://127.0.0.1:7777"


class Frame:  # what recv_multipart(copy=False) yields: `.buffer`
    def __init__(self, data: bytes) -> None:
        self.buffer = memoryview(data)


def _receiver():
    receiver = kv_frames.reply_receiver(ADDR)
    receiver.counter = DropCounter()
    return receiver


def _reply(kv: torch.Tensor, **overrides):
    raw = kv.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    fields = dict(shape=list(kv.shape), dtype=str(kv.dtype).removeprefix("torch."))
    fields.update(overrides)
    header = kv_frames.reply_sender(ADDR).encode(KVPullReply("r1", ok=True, **fields), [raw])
    return header, raw


def test_authentic_reply_round_trips():
    kv = torch.randn(2, 3, 4)
    header, raw = _reply(kv)
    reply, tensor = kv_frames.read_reply(_receiver(), [Frame(header), Frame(raw)])
    assert reply.request_id == "r1" and torch.equal(tensor, kv)


def test_inconsistent_or_tampered_replies_are_dropped():
    kv = torch.randn(2, 3, 4)
    for overrides, reason in (({"dtype": "Tensor"}, "invalid"), ({"shape": [2, 3, 5]}, "invalid"),
                              ({"shape": [-1, 24]}, "invalid"),
                              ({"shape": [1] * 9}, "invalid")):
        receiver = _receiver()
        header, raw = _reply(kv, **overrides)
        assert kv_frames.read_reply(receiver, [Frame(header), Frame(raw)]) is None
        assert receiver.counter.snapshot() == {("kv.reply", reason): 1}, overrides
    receiver = _receiver()
    header, raw = _reply(kv)
    tampered = bytearray(raw)
    tampered[0] ^= 1
    assert kv_frames.read_reply(receiver, [Frame(header), Frame(bytes(tampered))]) is None
    assert kv_frames.read_reply(receiver, [Frame(header)] * 3) is None
    assert receiver.counter.snapshot() == {("kv.reply", "mac"): 1, ("kv.reply", "frames"): 1}


def test_pulls_need_exactly_identity_and_one_signed_frame():
    receiver = kv_frames.pull_receiver(ADDR)
    receiver.counter = DropCounter()
    frame = kv_frames.pull_sender(ADDR).encode(KVPull("r1"))
    assert kv_frames.read_pull(receiver, [b"id", frame]) == (b"id", KVPull("r1"))
    assert kv_frames.read_pull(receiver, [b"id", b"a", b"b"]) is None
    assert kv_frames.read_pull(receiver, [b"id", frame]) is None  # replayed
    assert kv_frames.read_pull(receiver, [b"id", b"x" * 5000]) is None  # oversize
    assert receiver.counter.snapshot() == {("kv.pull", "frames"): 1, ("kv.pull", "replay"): 1,
                                           ("kv.pull", "oversize"): 1}
