"""Authenticated frames (deepinfer/wire): every tampered byte region, another key, replay,
oversize and type confusion are dropped with the right reason; good frames round-trip."""
from __future__ import annotations

import os

import msgspec
import pytest

from deepinfer.wire import drops
from deepinfer.wire.channel import ChannelReceiver, ChannelSender
from deepinfer.wire.drops import DropCounter
from deepinfer.wire.frame import HEADER_BYTES, FrameDropped, FrameSigner, FrameVerifier

KEY = os.urandom(32)
CHANNEL = "worker.input@tcp://127.0.0.1:5555"


class Ping(msgspec.Struct, tag=True):
    n: int
    text: str = ""


class Pong(msgspec.Struct, tag=True):
    n: int


def _pair(**kwargs):
    counter = DropCounter()
    return (ChannelSender(CHANNEL, KEY),
            ChannelReceiver(CHANNEL, Ping | Pong, KEY, counter=counter, **kwargs), counter)


def _reason(receiver, frame, attached=()):
    with pytest.raises(FrameDropped) as exc:
        receiver.decode_or_raise(frame, attached)
    return exc.value.reason


def test_round_trip_in_order():
    sender, receiver, counter = _pair()
    messages = [Ping(i, "x" * i) for i in range(5)] + [Pong(7)]
    assert [receiver.decode(sender.encode(m)) for m in messages] == messages
    assert counter.snapshot() == {}


# Byte offsets of the header fields: version 0, key id 1-4, sender 5-12, sequence 13-20,
# MAC 21-52, payload 53-.
@pytest.mark.parametrize("offset,reason", [
    (0, drops.VERSION), (1, drops.KEY), (4, drops.KEY), (5, drops.MAC), (12, drops.MAC),
    (13, drops.MAC), (20, drops.MAC), (21, drops.MAC), (52, drops.MAC), (53, drops.MAC),
    (-1, drops.MAC)])
def test_flipping_any_byte_is_detected(offset, reason):
    sender, receiver, _ = _pair()
    frame = bytearray(sender.encode(Ping(1, "hello world")))
    frame[offset] ^= 0x01
    assert _reason(receiver, bytes(frame)) == reason


def test_every_single_byte_flip_is_dropped():
    sender, receiver, _ = _pair()
    frame = sender.encode(Ping(3, "abc"))
    for i in range(len(frame)):
        tampered = bytearray(frame)
        tampered[i] ^= 0x80
        assert receiver.decode(bytes(tampered)) is None, i
    assert receiver.decode(frame) == Ping(3, "abc")  # the original is still fresh


def test_truncated_and_extended_frames():
    sender, receiver, _ = _pair()
    frame = sender.encode(Ping(1))
    assert _reason(receiver, b"") == drops.TRUNCATED
    assert _reason(receiver, frame[:HEADER_BYTES - 1]) == drops.TRUNCATED
    assert _reason(receiver, frame[:-1]) == drops.MAC
    assert _reason(receiver, frame + b"\x00") == drops.MAC


def test_another_deployments_key_is_reported_as_such():
    other = ChannelSender(CHANNEL, os.urandom(32))
    _, receiver, counter = _pair()
    assert receiver.decode(other.encode(Ping(1))) is None
    assert counter.snapshot() == {("worker.input", drops.KEY): 1}


def test_a_frame_of_another_channel_is_rejected():
    sender = ChannelSender("worker.input@tcp://127.0.0.1:6666", KEY)  # another endpoint
    _, receiver, _ = _pair()
    assert _reason(receiver, sender.encode(Ping(1))) == drops.MAC


def test_replay_and_reordering_are_dropped():
    sender, receiver, counter = _pair()
    first, second = sender.encode(Ping(1)), sender.encode(Ping(2))
    assert receiver.decode(first) == Ping(1)
    assert _reason(receiver, first) == drops.REPLAY
    assert receiver.decode(second) == Ping(2)
    assert receiver.decode(first) is None
    assert counter.snapshot() == {("worker.input", drops.REPLAY): 1}
    # Two senders (two sockets) have independent sequences.
    other = ChannelSender(CHANNEL, KEY)
    assert receiver.decode(other.encode(Pong(1))) == Pong(1)


def test_oversize_is_dropped_before_any_mac_work():
    sender, receiver, _ = _pair(max_frame_bytes=1024)
    assert receiver.decode(sender.encode(Ping(1, "x" * 100))) == Ping(1, "x" * 100)
    assert _reason(receiver, sender.encode(Ping(2, "x" * 2000))) == drops.OVERSIZE
    assert _reason(receiver, b"\x01" * 5000) == drops.OVERSIZE


def test_type_confusion_and_garbage_payloads():
    _, receiver, _ = _pair()
    signer = FrameSigner(CHANNEL, KEY)

    class Other(msgspec.Struct, tag=True):  # a message of another channel, correctly signed
        n: int

    assert _reason(receiver, signer.sign(msgspec.msgpack.encode(Other(1)))) == drops.TYPE
    assert _reason(receiver, signer.sign(msgspec.msgpack.encode({"type": "Ping", "n": "1"}))) \
        == drops.TYPE  # right tag, wrong field type
    assert _reason(receiver, signer.sign(msgspec.msgpack.encode([1, 2]))) == drops.TYPE
    assert _reason(receiver, signer.sign(b"\xc1\xc1")) == drops.DECODE
    assert _reason(receiver, signer.sign(b"\x91" * 100000)) in (drops.DECODE, drops.TYPE)


def test_attached_parts_are_covered_by_the_mac():
    signer, verifier = FrameSigner("kv.reply@x", KEY), FrameVerifier("kv.reply@x", KEY)
    payload = os.urandom(4096)
    frame = signer.sign(b"header", [payload])
    assert bytes(verifier.verify(frame, [payload])) == b"header"
    frame = signer.sign(b"header", [payload])
    tampered = bytearray(payload)
    tampered[100] ^= 1
    with pytest.raises(FrameDropped, match="mac"):
        verifier.verify(frame, [bytes(tampered)])
    frame = signer.sign(b"header", [payload])
    with pytest.raises(FrameDropped, match="mac"):  # parts cannot be moved or dropped
        verifier.verify(frame, [])


def test_drops_are_counted_by_kind_and_logged_once_per_interval(caplog):
    counter = DropCounter(log_interval_s=3600)
    with caplog.at_level("WARNING", logger="deepinfer.wire"):
        for _ in range(50):
            counter.record("engine.output@ipc:///tmp/x", drops.MAC)
        counter.record("engine.output@ipc:///tmp/y", drops.REPLAY)
    assert counter.snapshot() == {("engine.output", drops.MAC): 50,
                                  ("engine.output", drops.REPLAY): 1}
    assert len([r for r in caplog.records if r.name == "deepinfer.wire"]) == 2


def test_reports_from_other_processes_merge_and_ignore_junk():
    merged = drops.merge_reports({"engine.input/mac": 2, "kv.pull/frames": 1},
                                 {"engine.input/mac": 3, "bogus": 9, "x/not-a-reason": 1,
                                  "kv.pull/replay": -4})
    assert merged == {("engine.input", "mac"): 5, ("kv.pull", "frames"): 1}


def test_wire_sits_low_it_imports_neither_server_cluster_torch_nor_zmq():
    import subprocess
    import sys

    code = ("import sys, deepinfer.wire; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'zmq') "
            "or m.startswith(('deepinfer.server', 'deepinfer.cluster', 'deepinfer.ep'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == "[]"
