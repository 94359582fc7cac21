"""`DisaggClient` (the disaggregated front) against fake workers: real ZMQ sockets, no model,
no processes. Each test plays the workers' side of the protocol and checks what the front
sends back: aborts to every worker holding state when it gives up on a request, suspension
of a worker whose engine loop stopped advancing (and its return), and refusal of a prompt
that no decode worker's whole KV cache can hold."""
from __future__ import annotations

import asyncio
import time

import pytest
import zmq

from deepinfer.cluster.cluster_config import ClusterConfig
from deepinfer.clients.disagg import DisaggClient
from deepinfer.wire.worker_messages import (AbortRequests, ClusterInput, DecodeRequest, PrefillDone,
                                        PrefillRequest, WorkerCounters, WorkerFailed,
                                        WorkerHeartbeat, WorkerLoadReport, WorkerReady,
                                        WorkerReport)
from deepinfer.wire import TokenizerFiles
from deepinfer.wire.channel import ChannelReceiver, ChannelSender, channel_name
from deepinfer.cluster.worker_channels import bind_worker_input
from deepinfer.cluster.worker_handle import WorkerHandle
from deepinfer.cluster.worker_spec import WorkerSpec
from deepinfer.engine.engine_config import EngineConfig
from deepinfer.routing import RoutingRequest
from deepinfer.sampling_params import SamplingParams
from deepinfer.engine.exceptions import EngineDeadError
from deepinfer.wire.engine_messages import ChoiceDelta, RequestDelta, RequestError
from tests.unit.hello_fakes import hello_dealer

pytestmark = pytest.mark.timeout(60)
PARAMS = SamplingParams(temperature=0.0, max_tokens=8)
BLOCK = 16


class FakeWorker:
    """The worker end of one front input socket, plus a socket to the front's output."""

    def __init__(self, client: DisaggClient, ctx: zmq.Context, worker_id: str, role: str,
                 num_kv_blocks: int = 64) -> None:
        self.worker_id, self.role, self.num_kv_blocks = worker_id, role, num_kv_blocks
        sock = bind_worker_input(client._ctx, "127.0.0.1", worker_id)
        spec = WorkerSpec(worker_id=worker_id, role=role, engine_config=None,
                          input_addr=sock.address, output_addr=client._output_addr)
        self.handle = WorkerHandle(spec, sock)
        self.handle.ready = WorkerReady(worker_id, role, 0, "tcp://127.0.0.1:1", "m", 4096, 1000,
                                        BLOCK, num_kv_blocks, 16, TokenizerFiles())
        now = time.monotonic()
        self.handle.last_seen = self.handle.last_loop_advance = now
        self.handle.last_report = self.load_report()
        self.handle.load = self.handle.to_worker_load(self.handle.last_report, now)
        client.workers[worker_id] = self.handle
        client.supervisor.add_worker(worker_id, role, now)
        self.ctx, self.spec = ctx, spec
        self.inbox = self.out = None  # DEALERs, once `connect` said hello on both
        # A fake worker holds the cluster secret, as a real one does.
        self.decoder = ChannelReceiver(channel_name("worker.input", spec.input_addr),
                                       ClusterInput)
        self.encoder = ChannelSender(channel_name("worker.output", client._output_addr))
        self.received: list = []

    async def connect(self) -> None:
        """Say hello on both sockets, as a worker process does (the front's loops run)."""
        self.inbox = await hello_dealer(self.ctx, self.worker_id, self.spec.input_addr)
        self.out = await hello_dealer(self.ctx, self.worker_id, self.spec.output_addr)

    def load_report(self) -> WorkerLoadReport:
        return WorkerLoadReport(0, 0, 0, 0, self.num_kv_blocks, BLOCK, 0, 16)

    def send(self, message) -> None:
        self.out.send(self.encoder.encode(message))

    def report(self, **kwargs) -> None:
        self.send(WorkerReport(self.worker_id, self.load_report(), WorkerCounters(), **kwargs))

    async def expect(self, kind, timeout: float = 10.0):
        """The next message of type `kind` the front sends this worker (bounded wait)."""
        deadline = time.monotonic() + timeout
        while True:
            for i, m in enumerate(self.received):
                if isinstance(m, kind):
                    return self.received.pop(i)
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.worker_id} got no {kind.__name__} in {timeout} s "
                                     f"(got {self.received})")
            while self.inbox.poll(0):
                self.received.append(self.decoder.decode(self.inbox.recv()))
            await asyncio.sleep(0.01)

    def drain(self) -> list:
        while self.inbox.poll(0):
            self.received.append(self.decoder.decode(self.inbox.recv()))
        out, self.received = self.received, []
        return out


async def until(predicate, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def first_token(request_id: str, worker: FakeWorker) -> None:
    """A prefill worker's answer: the first token, and its KV staged for decode."""
    worker.report(outputs=[RequestDelta(request_id, [ChoiceDelta(0, "a", [5])], False)],
                  prefill_done=[PrefillDone(request_id, 5, None, 1, "tcp://127.0.0.1:1", 64)])


def run_front(test, **config):
    """Run `test(client, workers)` on a front with fake P=2 (p0, p1) and D=2 (d0, d1)."""
    config.setdefault("heartbeat_timeout_s", 60.0)
    config.setdefault("kv_store_url", "none")
    config.setdefault("max_worker_restarts", 0)  # no real processes here
    decode_blocks = config.pop("decode_blocks", 64)

    async def main():
        client = DisaggClient(EngineConfig(block_size=BLOCK), ClusterConfig(num_prefill_workers=2, num_decode_workers=2,
                                                  **config))
        ctx = zmq.Context()
        workers = {wid: FakeWorker(client, ctx, wid, wid[0] == "p" and "prefill" or "decode",
                                   64 if wid[0] == "p" else decode_blocks)
                   for wid in ("p0", "p1", "d0", "d1")}
        await drive_front(client, ctx, workers, test)
    asyncio.run(main())


async def drive_front(client, ctx: zmq.Context, workers: dict, test) -> None:
    """Run `test(client, workers)` with the front's output and health loops going, then close
    every socket (the front's, the fake workers') and both contexts."""
    client.tokenizer = object()
    client._tasks = [asyncio.create_task(client.inbox.run()),
                     asyncio.create_task(client.health.run())]
    try:
        await asyncio.gather(*(w.connect() for w in workers.values()))
        await test(client, workers)
    finally:
        for task in client._tasks:
            task.cancel()
        for w in workers.values():
            for sock in (w.inbox, w.out):
                if sock is not None:
                    sock.close(linger=0)
            w.handle.input_socket.close(linger=0)
        client._output.close(linger=0)
        client._ctx.term()
        ctx.term()


async def consume(client, request_id: str, prompt=None) -> dict:
    tokens, error = [], None
    try:
        async for delta in client.generate(request_id, prompt or list(range(1, 40)), PARAMS):
            tokens += delta.choices[0].token_ids
    except Exception as exc:
        error = exc
    return {"tokens": tokens, "error": error}


async def to_decode(client, workers, request_id: str):
    """Start a request and play its prefill; returns (task, prefill worker, decode worker)."""
    task = asyncio.create_task(consume(client, request_id))
    await until(lambda: request_id in client.placements, "the request routed")
    p = workers[client.placements[request_id][0]]
    await p.expect(PrefillRequest)
    first_token(request_id, p)
    await until(lambda: client.placements[request_id][1] is not None, "decode routing")
    d = workers[client.placements[request_id][1]]
    await d.expect(DecodeRequest)
    return task, p, d


def test_stall_timeout_aborts_on_the_prefill_and_the_decode_worker():
    async def test(client, workers):
        task, p, d = await to_decode(client, workers, "r")
        # The decode worker never answers: the stall timeout gives up on the request...
        result = await asyncio.wait_for(task, 20)
        assert isinstance(result["error"], EngineDeadError) and "no progress" in str(result["error"])
        # ...and frees it everywhere: the staged KV on p, the blocks / pull on d.
        assert (await p.expect(AbortRequests)).request_ids == ["r"]
        assert (await d.expect(AbortRequests)).request_ids == ["r"]
    run_front(test, stall_timeout_s=1.0)


def test_a_decode_side_failure_releases_the_staged_kv_at_once():
    async def test(client, workers):
        task, p, d = await to_decode(client, workers, "r")
        d.report(errors=[RequestError("r", "KV transfer failed: connection refused")])
        result = await asyncio.wait_for(task, 20)
        assert "KV transfer failed" in str(result["error"])
        assert (await p.expect(AbortRequests)).request_ids == ["r"]  # not at its TTL
    run_front(test)


def test_losing_the_prefill_worker_cancels_the_pull_on_the_decode_worker():
    async def test(client, workers):
        task, p, d = await to_decode(client, workers, "r")
        p.send(WorkerFailed(p.worker_id, "Traceback ...\nRuntimeError: boom"))
        result = await asyncio.wait_for(task, 20)
        assert "before decode worker" in str(result["error"]) and p.worker_id in str(result["error"])
        assert (await d.expect(AbortRequests)).request_ids == ["r"]  # frees its blocks now
    run_front(test)


def test_after_the_kv_arrived_losing_the_prefill_worker_does_not_touch_the_request():
    async def test(client, workers):
        task, p, d = await to_decode(client, workers, "r")
        d.report(kv_received=["r"])
        d.report(outputs=[RequestDelta("r", [ChoiceDelta(0, "b", [6])], False)])
        await until(lambda: client._requests["r"].num_tokens_streamed == 2, "2 tokens")
        p.send(WorkerFailed(p.worker_id, "RuntimeError: boom"))
        await until(lambda: not client.workers[p.worker_id].alive, "p out of routing")
        d.report(outputs=[RequestDelta("r", [ChoiceDelta(0, "c", [7], finish_reason="length")],
                                       True)])
        result = await asyncio.wait_for(task, 20)
        assert result["error"] is None and result["tokens"] == [5, 6, 7]
        assert not any(isinstance(m, AbortRequests) for m in d.drain())
    run_front(test)


def test_a_client_disconnect_aborts_both_sides():
    async def test(client, workers):
        gen = client.generate("r", list(range(1, 40)), PARAMS)
        first = asyncio.ensure_future(gen.__anext__())
        await until(lambda: "r" in client.placements, "the request routed")
        p = workers[client.placements["r"][0]]
        await p.expect(PrefillRequest)
        first_token("r", p)
        await asyncio.wait_for(first, 10)
        await until(lambda: client.placements["r"][1] is not None, "decode routing")
        d = workers[client.placements["r"][1]]
        await gen.aclose()  # the client went away after the first token
        assert (await p.expect(AbortRequests)).request_ids == ["r"]
        assert (await d.expect(AbortRequests)).request_ids == ["r"]
    run_front(test)


def test_a_worker_whose_loop_stopped_advancing_is_suspended_and_comes_back():
    async def test(client, workers):
        task = asyncio.create_task(consume(client, "r"))
        await until(lambda: "r" in client.placements, "the request routed")
        hung = workers[client.placements["r"][0]]
        other = workers["p1" if hung.worker_id == "p0" else "p0"]
        await hung.expect(PrefillRequest)
        # Every process lives and beats; the hung one's loop stops advancing from now on.
        hung_at = [time.monotonic()]  # None once its loop runs again

        async def beat():
            while True:
                for w in workers.values():
                    age = time.monotonic() - hung_at[0] if w is hung and hung_at[0] else 0.0
                    w.send(WorkerHeartbeat(w.worker_id, loop_age_s=age))
                await asyncio.sleep(0.1)
        beating = asyncio.create_task(beat())
        retried = await other.expect(PrefillRequest)  # nothing streamed yet: moved
        assert retried.request_id == "r" and not client.workers[hung.worker_id].alive
        assert client.health.num_suspended == 1 and client.health.num_retried == 1
        assert (await hung.expect(AbortRequests)).request_ids == ["r"]  # read when it resumes
        # A late output of the suspended worker for the moved request is ignored.
        first_token("r", hung)
        first_token("r", other)
        await until(lambda: client.placements["r"][1] is not None, "decode routing")
        d = workers[client.placements["r"][1]]
        await d.expect(DecodeRequest)
        d.report(kv_received=["r"], outputs=[RequestDelta(
            "r", [ChoiceDelta(0, "b", [6], finish_reason="length")], True)])
        result = await asyncio.wait_for(task, 20)
        assert result["error"] is None and result["tokens"] == [5, 6]
        # Its loop advances again (a report comes from the loop): back in routing.
        hung_at[0] = None
        hung.report()
        await until(lambda: client.workers[hung.worker_id].alive, "back in routing")
        assert client.prefill_router.route(RoutingRequest("x", 10), [
            client.workers[hung.worker_id].load], time.monotonic()) == hung.worker_id
        beating.cancel()
    run_front(test, loop_stall_timeout_s=2.0)


def test_a_prompt_larger_than_every_decode_cache_is_refused_before_prefill():
    async def test(client, workers):
        # Decode workers hold 4 blocks of 16 = 64 tokens each; prefill workers hold more.
        with pytest.raises(ValueError, match="whole KV cache holds 64 tokens"):
            await consume_raising(client, "big", list(range(1, 101)))
        assert workers["p0"].drain() == [] and workers["p1"].drain() == []
        assert "big" not in client._requests
        ok = asyncio.create_task(consume(client, "ok", list(range(1, 60))))
        await until(lambda: "ok" in client.placements, "the request routed")
        await workers[client.placements["ok"][0]].expect(PrefillRequest)
        ok.cancel()
    run_front(test, decode_blocks=4)


async def consume_raising(client, request_id: str, prompt) -> None:
    async def run():
        async for _ in client.generate(request_id, prompt, PARAMS):
            pass
    await asyncio.wait_for(run(), 5)
