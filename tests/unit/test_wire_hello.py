"""The worker hello (wire/hello.py) and the front sockets built on it
(cluster/worker_channels.py): a connection is bound to a worker only by answering the nonce
issued to it, with the cluster secret, for a worker expected there and not bound elsewhere.
Forged, replayed, misdirected and late hellos are dropped and counted, and the bound
worker keeps its binding; on real sockets a stray DEALER or PULL on a worker's input port
gets nothing, and a report naming another worker than its connection's is dropped."""
from __future__ import annotations

import asyncio
import os
import time

import pytest
import zmq
import zmq.asyncio

from deepinfer.cluster.worker_channels import bind_worker_input, bind_worker_output
from deepinfer.wire import ChannelReceiver, ChannelSender, DropCounter, PROCESS_DROPS
from deepinfer.wire.hello import (Challenge, FrontHello, Hello, HelloGate, HelloRequest, Welcome,
                                  challenge_channel, hello_channel)
from deepinfer.wire.worker_messages import (ClusterInput, PrefillRequest, WorkerCounters,
                                            WorkerHeartbeat, WorkerMessage)
from deepinfer.sampling_params import SamplingParams
from tests.unit.hello_fakes import dealer, hello_dealer

pytestmark = pytest.mark.timeout(60)
ADDR = "tcp://10.0.0.1:5000"
A, B = b"wA" + bytes(14), b"wB" + bytes(14)  # two connections' routing ids


class Peer:
    """One connection's worker side, without sockets: signs what it sends, reads replies."""

    def __init__(self, key: bytes | None = None) -> None:
        self.sender = ChannelSender(hello_channel(ADDR), key)
        self.receiver = ChannelReceiver(challenge_channel(ADDR), FrontHello,
                                        counter=DropCounter())

    def ask(self, worker_id: str) -> bytes:
        return self.sender.encode(HelloRequest(worker_id))

    def answer(self, worker_id: str, nonce: bytes) -> bytes:
        return self.sender.encode(Hello(worker_id, nonce))

    def read(self, reply: bytes | None):
        assert reply is not None
        return self.receiver.decode_or_raise(reply)


def gate_for(worker_id: str = "prefill-0") -> tuple[HelloGate, DropCounter]:
    counter = DropCounter()
    return HelloGate(ADDR, lambda wid: wid == worker_id, counter=counter), counter


def bind(gate: HelloGate, rid: bytes, peer: Peer, worker_id: str = "prefill-0") -> bytes:
    """A full hello on connection `rid` -> the recorded Hello frame."""
    challenge = peer.read(gate.on_frame(rid, [peer.ask(worker_id)]))
    assert isinstance(challenge, Challenge) and len(challenge.nonce) == 16
    hello = peer.answer(worker_id, challenge.nonce)
    welcome = peer.read(gate.on_frame(rid, [hello]))
    assert welcome == Welcome(worker_id)
    assert gate.rid_of(worker_id) == rid and gate.worker_of(rid) == worker_id
    return hello


def drops_of(counter: DropCounter) -> dict:
    return {reason: n for (channel, reason), n in counter.snapshot().items()
            if channel == "worker.hello"}


def test_a_worker_binds_by_answering_its_own_challenge():
    gate, counter = gate_for()
    bind(gate, A, Peer())
    assert drops_of(counter) == {}


def test_a_forged_hello_is_dropped_and_binds_nothing():
    gate, counter = gate_for()
    peer = Peer()
    nonce = peer.read(gate.on_frame(A, [peer.ask("prefill-0")])).nonce
    forged = bytearray(peer.answer("prefill-0", nonce))
    forged[30] ^= 0xFF  # inside the MAC
    assert gate.on_frame(A, [bytes(forged)]) is None
    other_key = Peer(os.urandom(32)).answer("prefill-0", nonce)  # another deployment's secret
    assert gate.on_frame(A, [other_key]) is None
    assert gate.on_frame(A, [b"garbage"]) is None
    assert gate.on_frame(A, [peer.ask("prefill-0"), b"x"]) is None  # two parts
    assert gate.rid_of("prefill-0") is None
    assert drops_of(counter) == {"mac": 1, "key": 1, "truncated": 1, "frames": 1}
    # An unsigned connection is never even challenged.
    assert gate.on_frame(B, [Peer(os.urandom(32)).ask("prefill-0")]) is None


def test_a_recorded_hello_replayed_from_another_connection_is_dropped():
    gate, counter = gate_for()
    recorded = bind(gate, A, Peer())
    gate.release("prefill-0")  # even with the worker free (its process restarting)
    assert gate.on_frame(B, [recorded]) is None
    assert gate.rid_of("prefill-0") is None and gate.worker_of(B) is None
    # The same answer re-signed as a fresh frame (a key holder replaying the nonce) still
    # fails: that nonce was issued to A, and spent.
    thief = Peer()
    thief.read(gate.on_frame(B, [thief.ask("prefill-0")]))
    stale = Hello("prefill-0", _nonce_of(recorded))
    assert gate.on_frame(B, [thief.sender.encode(stale)]) is None
    assert gate.rid_of("prefill-0") is None
    assert drops_of(counter) == {"replay": 1, "hello": 1}


def _nonce_of(hello_frame: bytes) -> bytes:
    return ChannelReceiver(hello_channel(ADDR), Hello, counter=DropCounter()).decode_or_raise(
        hello_frame).nonce


def test_a_hello_for_another_worker_or_with_a_wrong_nonce_is_dropped():
    gate, counter = gate_for()
    peer = Peer()
    assert gate.on_frame(A, [peer.ask("decode-0")]) is None  # not the worker of this socket
    nonce = peer.read(gate.on_frame(A, [peer.ask("prefill-0")])).nonce
    assert gate.on_frame(A, [peer.answer("decode-0", nonce)]) is None
    assert gate.on_frame(A, [peer.answer("prefill-0", os.urandom(16))]) is None  # wrong nonce
    other = Peer()  # B's nonce answered on A's connection
    nonce_b = other.read(gate.on_frame(B, [other.ask("prefill-0")])).nonce
    assert nonce_b != nonce
    assert gate.on_frame(A, [peer.answer("prefill-0", nonce_b)]) is None
    assert gate.rid_of("prefill-0") is None
    assert drops_of(counter) == {"hello": 4}
    # The right answer still binds: drops spend nothing.
    assert peer.read(gate.on_frame(A, [peer.answer("prefill-0", nonce)])) == Welcome("prefill-0")


def test_a_second_connection_cannot_take_a_bound_worker():
    gate, counter = gate_for()
    bind(gate, A, Peer())
    intruder = Peer()  # holds the secret, but the worker is bound to A
    assert gate.on_frame(B, [intruder.ask("prefill-0")]) is None
    assert gate.rid_of("prefill-0") == A and gate.worker_of(B) is None
    assert drops_of(counter) == {"hello": 1}
    gate.release("prefill-0")  # a restart: the new process binds on its own connection
    bind(gate, B, intruder)
    assert gate.worker_of(A) is None


def test_a_worker_binds_one_connection_per_slot_it_may_use():
    counter = DropCounter()
    gate = HelloGate(ADDR, lambda wid: wid == "prefill-0", counter=counter,
                     slots=("", "heartbeat"))
    reports, beats = Peer(), Peer()
    # A nonce issued for one slot does not answer for another.
    nonce = beats.read(gate.on_frame(B, [beats.sender.encode(
        HelloRequest("prefill-0", "heartbeat"))])).nonce
    assert gate.on_frame(B, [beats.sender.encode(Hello("prefill-0", nonce, ""))]) is None
    assert gate.rid_of("prefill-0") is None and drops_of(counter) == {"hello": 1}
    bind(gate, A, reports)
    nonce = beats.read(gate.on_frame(B, [beats.sender.encode(
        HelloRequest("prefill-0", "heartbeat"))])).nonce
    assert beats.read(gate.on_frame(B, [beats.sender.encode(
        Hello("prefill-0", nonce, "heartbeat"))])) == Welcome("prefill-0")
    assert gate.rid_of("prefill-0") == A and gate.rid_of("prefill-0", "heartbeat") == B
    assert gate.worker_of(B) == "prefill-0"
    third = Peer()  # a second heartbeat connection, or a slot not offered here
    assert gate.on_frame(b"wC" + bytes(14), [third.sender.encode(
        HelloRequest("prefill-0", "heartbeat"))]) is None
    assert gate.on_frame(b"wC" + bytes(14), [third.sender.encode(
        HelloRequest("prefill-0", "other"))]) is None
    assert drops_of(counter) == {"hello": 3}
    gate.release("prefill-0")  # a restart frees every slot
    assert gate.worker_of(A) is None and gate.worker_of(B) is None


def test_a_repeated_ask_keeps_the_nonce_in_flight():
    gate, counter = gate_for()
    peer = Peer()
    first = peer.read(gate.on_frame(A, [peer.ask("prefill-0")])).nonce
    again = peer.read(gate.on_frame(A, [peer.ask("prefill-0")])).nonce
    assert first == again
    assert peer.read(gate.on_frame(A, [peer.answer("prefill-0", first)])) == Welcome("prefill-0")
    assert drops_of(counter) == {}


# --- real sockets ------------------------------------------------------------------------------
def _drops(channel: str, reason: str) -> int:
    return PROCESS_DROPS.snapshot().get((channel, reason), 0)


def _close_all(sockets, bound, *contexts) -> None:
    """The test's own sockets, then the front's bound one, then the contexts."""
    for sock in sockets:
        sock.close(linger=0)
    bound.close()
    for ctx in contexts:
        ctx.term()


def test_strays_on_a_worker_input_get_nothing_and_the_worker_gets_everything():
    async def main():
        actx = zmq.asyncio.Context()
        ctx = zmq.Context()
        front = bind_worker_input(actx, "127.0.0.1", "prefill-0")
        strays = [dealer(ctx, front.address)]  # connected before the worker: no head start
        pull = ctx.socket(zmq.PULL)
        pull.setsockopt(zmq.LINGER, 0)
        pull.connect(front.address)
        strays.append(pull)
        try:
            await _strays_get_nothing(front, ctx, strays)
        finally:
            _close_all(strays, front, ctx, actx)
    asyncio.run(main())


async def _strays_get_nothing(front, ctx, strays):
    mac_before = _drops("worker.hello", "mac")
    with pytest.raises(zmq.Again):  # nobody has said hello: nothing can be sent
        await front.send(b"x")
    worker = await hello_dealer(ctx, "prefill-0", front.address)
    # A stray DEALER that says hello with a forged frame is not welcomed either.
    forged = bytearray(ChannelSender(hello_channel(front.address)).encode(
        HelloRequest("prefill-0")))
    forged[30] ^= 0xFF
    strays[0].send(bytes(forged))
    sender = ChannelSender(f"worker.input@{front.address}")
    for i in range(50):
        await front.send(sender.encode(PrefillRequest(f"r{i}", [1, 2], SamplingParams(),
                                                      0.0)))
    receiver = ChannelReceiver(f"worker.input@{front.address}", ClusterInput)
    got = []
    while len(got) < 50 and await asyncio.to_thread(worker.poll, 2000):
        got.append(receiver.decode_or_raise(worker.recv()).request_id)
    await asyncio.sleep(0.2)
    assert got == [f"r{i}" for i in range(50)]
    assert [s.poll(0) for s in strays] == [0, 0]
    assert _drops("worker.hello", "mac") == mac_before + 1
    strays.append(worker)  # closed by the caller


def test_a_report_naming_another_worker_is_dropped_and_counted():
    async def main():
        actx = zmq.asyncio.Context()
        ctx = zmq.Context()
        workers = {"prefill-0", "decode-0"}
        out = bind_worker_output(actx, "127.0.0.1", WorkerMessage, workers.__contains__)
        before = _drops("worker.output", "sender_mismatch")
        reader = asyncio.create_task(_collect(out))
        socks = [await hello_dealer(ctx, "prefill-0", out.address),
                 await hello_dealer(ctx, "decode-0", out.address),
                 dealer(ctx, out.address)]  # the last never said hello
        try:
            await _reports(out, reader, before, *socks)
        finally:
            reader.cancel()
            _close_all(socks, out, ctx, actx)
    asyncio.run(main())


async def _reports(out, reader, before, p0, d0, stray):
    channel = f"worker.output@{out.address}"
    sender_p, sender_d = ChannelSender(channel), ChannelSender(channel)
    p0.send(sender_p.encode(WorkerHeartbeat("decode-0", 1.0)))  # p0 claims to be d0
    stray.send(ChannelSender(channel).encode(WorkerHeartbeat("prefill-0", 2.0)))
    d0.send(sender_d.encode(WorkerHeartbeat("decode-0", 3.0)))
    p0.send(sender_p.encode(WorkerHeartbeat("prefill-0", 4.0)))
    messages = await asyncio.wait_for(reader, 10)
    assert [(m.worker_id, m.loop_age_s) for m in messages] == [("decode-0", 3.0),
                                                               ("prefill-0", 4.0)]
    assert _drops("worker.output", "sender_mismatch") == before + 1


async def _collect(out, n: int = 2) -> list:
    got = []
    while len(got) < n:
        message = await out.recv_message()
        if message is not None:
            got.append(message)
    return got


def test_counters_still_parse_with_the_new_reasons():
    from deepinfer.wire.drops import merge_reports
    report = {"worker.hello/hello": 2, "worker.output/sender_mismatch": 1}
    assert merge_reports(report) == {("worker.hello", "hello"): 2,
                                     ("worker.output", "sender_mismatch"): 1}
    assert WorkerCounters(wire_frames_dropped=report).wire_frames_dropped == report


def test_a_slow_welcome_draws_no_second_ask():
    """Once challenged, a worker waits for its welcome: a late re-ask would land on a bound
    connection (a dropped 'report')."""
    import threading
    from deepinfer.wire.hello import say_hello
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    addr = f"tcp://127.0.0.1:{port}"
    gate = HelloGate(addr, lambda wid: wid == "w", counter=DropCounter())
    worker = dealer(ctx, addr)
    done = threading.Event()
    thread = threading.Thread(target=lambda: (say_hello(worker, "w", addr, 10.0, 0.05),
                                              done.set()))
    try:
        thread.start()
        assert router.poll(5000)
        rid, ask = router.recv_multipart()
        router.send_multipart([rid, gate.on_frame(rid, [ask])])
        while True:  # asks sent before the challenge arrived, then the answer
            assert router.poll(5000)
            rid, frame = router.recv_multipart()
            reply = gate.on_frame(rid, [frame])
            if gate.worker_of(rid) == "w":
                break
            router.send_multipart([rid, reply])  # the same nonce again: answered again
        time.sleep(0.3)  # a slow front: six retry intervals before the welcome
        router.send_multipart([rid, reply])
        thread.join(5)
        assert done.is_set()
        extra = []
        while router.poll(300):
            extra.append(router.recv_multipart())
        assert extra == []
    finally:
        thread.join(5)
        worker.close(linger=0)
        router.close(linger=0)
        ctx.term()

