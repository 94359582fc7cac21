"""Scaling a disaggregated front while it serves (`DisaggClient.scale`), against fake workers
(real ZMQ sockets, no model, no processes; a fake launcher hands out process stand-ins):
a removed worker leaves routing at once but is shut down only after its request finished; an
added worker is routed to only after its WorkerReady and first report; a worker that dies
while draining is not restarted. Plus the pure parts: which worker goes, supervisor states."""
from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import pytest
import zmq

from deepinfer.wire.worker_messages import (ClusterInput, PrefillRequest, ShutdownWorker,
                                        WorkerCounters, WorkerFailed, WorkerReady,
                                        WorkerReport)
from deepinfer.cluster.worker_scaling import removal_order
from deepinfer.cluster.worker_supervisor import RestartPolicy, WorkerState, WorkerSupervisor
from deepinfer.wire.engine_messages import ChoiceDelta, RequestDelta
from deepinfer.wire import TokenizerFiles
from deepinfer.wire.channel import ChannelReceiver, ChannelSender, channel_name
from tests.unit.hello_fakes import hello_dealer
from tests.unit.test_disagg_client_faults import (BLOCK, PARAMS, FakeWorker, run_front,
                                                  to_decode, until)

pytestmark = pytest.mark.timeout(60)


class FakeProc:
    """A worker process stand-in: alive until killed."""

    def __init__(self, spec, pid: int) -> None:
        self.spec, self.pid, self.exitcode, self.started = spec, pid, None, False

    def start(self) -> None:
        self.started = True

    def is_alive(self) -> bool:
        return self.started and self.exitcode is None

    def join(self, timeout=None) -> None:
        pass

    def kill(self) -> None:
        self.exitcode = -9


class FakeLauncher:
    name = "fake"

    def __init__(self) -> None:
        self.procs: list[FakeProc] = []

    def process(self, spec) -> FakeProc:
        self.procs.append(FakeProc(spec, 4000 + len(self.procs)))
        return self.procs[-1]

    def placement(self, proc) -> dict:
        return {"pid": proc.pid}


def give_procs(client, workers) -> None:
    client.launcher = FakeLauncher()
    for w in workers.values():
        w.handle.proc = FakeProc(w.handle.spec, 1)
        w.handle.proc.start()


def finish(worker: FakeWorker, request_id: str) -> None:
    worker.report(outputs=[RequestDelta(request_id, [ChoiceDelta(0, "b", [6], finish_reason="length")], True)])


def test_a_removed_decode_worker_drains_its_request_before_it_is_shut_down():
    async def test(client, workers):
        give_procs(client, workers)
        task, p, d = await to_decode(client, workers, "r")
        d.report(kv_received=["r"])
        scaling = asyncio.create_task(client.scale("decode", 1))
        await until(lambda: client.scaler is not None and d.worker_id in client.scaler.retiring,
                    "the scale-down started")
        assert d.worker_id in [h["worker_id"] for h in client.describe_workers()
                               if h["state"] == "retiring"]
        other = next(w for w in ("d0", "d1") if w != d.worker_id)
        # New requests go to the remaining worker while the removed one still serves "r".
        task2, _, d2 = await to_decode(client, workers, "r2")
        assert d2.worker_id == other
        await asyncio.sleep(0.3)  # scaling polls every 50 ms: it must still be waiting
        assert not scaling.done() and not any(isinstance(m, ShutdownWorker) for m in d.drain())
        finish(d, "r")
        result = await asyncio.wait_for(scaling, 10)
        assert result["removed"] == [d.worker_id] and result["num_released"] == 0
        await d.expect(ShutdownWorker)
        assert d.worker_id not in client.workers
        assert (await asyncio.wait_for(task, 10)) == {"tokens": [5, 6], "error": None}
        finish(d2, "r2")
        assert (await asyncio.wait_for(task2, 10))["error"] is None
    run_front(test)


def test_an_added_worker_is_routed_to_only_after_it_is_ready_and_reported():
    async def test(client, workers):
        give_procs(client, workers)
        result = await client.scale("prefill", 3, wait=False)
        assert result["added"] == ["prefill-1"] and result["not_ready"] == ["prefill-1"]
        handle = client.workers["prefill-1"]
        assert handle.proc is client.launcher.procs[0] and handle.proc.started
        assert client.supervisor.state("prefill-1") is WorkerState.STARTING
        assert client.supervisor.num_restarts["prefill"] == 0  # not a restart
        ctx = zmq.Context()
        inbox = await hello_dealer(ctx, "prefill-1", handle.spec.input_addr)
        out = await hello_dealer(ctx, "prefill-1", client._output_addr)
        try:
            # Loading: requests go to p0 / p1 only.
            for i in range(4):
                task, p, d = await to_decode(client, workers, f"a{i}")
                assert p.worker_id in ("p0", "p1")
                finish(d, f"a{i}")
                await asyncio.wait_for(task, 10)
            enc = ChannelSender(channel_name("worker.output", client._output_addr))
            out.send(enc.encode(WorkerReady("prefill-1", "prefill", 4000, "tcp://127.0.0.1:1",
                                            "m", 4096, 1000, BLOCK, 64, 16, TokenizerFiles(),
                                            weights_fingerprint="f" * 32)))
            new = SimpleNamespace(load_report=workers["p0"].load_report)
            out.send(enc.encode(WorkerReport("prefill-1", new.load_report(), WorkerCounters())))
            await until(lambda: handle.alive, "prefill-1 admitted")
            assert client.supervisor.state("prefill-1") is WorkerState.ALIVE
            # Now it takes requests: p0 and p1 are busy with queued prompts, it is not.
            tasks = [asyncio.create_task(_consume(client, f"b{i}")) for i in range(3)]
            await until(lambda: all(f"b{i}" in client.placements for i in range(3)), "routed")
            assert "prefill-1" in {client.placements[f"b{i}"][0] for i in range(3)}
            await until(lambda: inbox.poll(0), "a message to prefill-1")
            receiver = ChannelReceiver(channel_name("worker.input", handle.spec.input_addr),
                                       ClusterInput)
            assert isinstance(receiver.decode(inbox.recv()), PrefillRequest)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            inbox.close(linger=0)
            out.close(linger=0)
            ctx.term()
            handle.input_socket.close(linger=0)  # run_front closes only its fake workers'
    run_front(test)


def test_a_worker_that_dies_while_draining_is_removed_not_restarted():
    async def test(client, workers):
        give_procs(client, workers)
        task, p, d = await to_decode(client, workers, "r")
        d.report(kv_received=["r"])
        d.report(outputs=[RequestDelta("r", [ChoiceDelta(0, "b", [6])], False)])
        await until(lambda: client._requests["r"].num_tokens_streamed == 2, "2 tokens")
        scaling = asyncio.create_task(client.scale("decode", 1))
        await until(lambda: client.scaler is not None and d.worker_id in client.scaler.retiring,
                    "the scale-down started")
        d.send(WorkerFailed(d.worker_id, "RuntimeError: boom"))
        result = await asyncio.wait_for(scaling, 10)
        assert result["removed"] == [d.worker_id]
        failed = await asyncio.wait_for(task, 10)
        assert d.worker_id in str(failed["error"]) and "lost" in str(failed["error"])
        assert d.worker_id not in client.workers
        await asyncio.sleep(0.3)  # past the restart back-off: nothing restarts it
        assert d.worker_id not in client.workers and client.launcher.procs == []
    run_front(test, max_worker_restarts=3, restart_backoff_s=0.05)


def test_scale_refuses_bad_input_and_keeps_one_worker_per_role():
    async def test(client, workers):
        give_procs(client, workers)
        for role, count, message in (("encode", 1, "role must be"), ("decode", 0, "count must"),
                                     ("decode", True, "count must")):
            with pytest.raises(ValueError, match=message):
                await client.scale(role, count)
        client.cluster = dataclasses.replace(client.cluster, cpu_affinity=True)
        with pytest.raises(ValueError, match="--cpu-affinity"):
            await client.scale("decode", 3)  # its core groups were fixed at start
        client.cluster = dataclasses.replace(client.cluster, cpu_affinity=False)
        assert (await client.scale("decode", 2)) == {
            "role": "decode", "count": 2, "added": [], "removed": [], "not_ready": [],
            "waiting_for": {}, "num_released": 0}
    run_front(test)


async def _consume(client, request_id: str) -> None:
    async for _ in client.generate(request_id, list(range(1, 40)), PARAMS):
        pass


def test_removal_order_takes_workers_out_of_service_first_then_the_newest():
    def h(wid, alive=True):
        return SimpleNamespace(worker_id=wid, alive=alive, request_ids=set())
    workers = [h("decode-0"), h("decode-1"), h("decode-2", alive=False), h("decode-3")]
    states = {"decode-0": WorkerState.ALIVE, "decode-1": WorkerState.GAVE_UP,
              "decode-2": WorkerState.BACKOFF, "decode-3": WorkerState.ALIVE}
    order = [w.worker_id for w in removal_order(workers, states)]
    assert order == ["decode-2", "decode-1", "decode-3", "decode-0"]


def test_supervisor_admits_an_added_worker_and_never_restarts_a_retired_one():
    sup = WorkerSupervisor(RestartPolicy(initial_backoff_s=1.0, max_restarts=3))
    sup.add_starting("decode-1", "decode", now=0.0)
    assert sup.state("decode-1") is WorkerState.STARTING and sup.start_overdue(1.0) == []
    assert sup.on_admitted("decode-1", now=5.0) is None  # no outage: it was never lost
    assert sup.num_restarts["decode"] == 0
    sup.retire("decode-1")
    assert sup.on_lost("decode-1", "exited", now=6.0).gave_up
    assert sup.due(100.0) == [] and sup.num_gave_up["decode"] == 0
    sup.remove("decode-1")
    sup.remove("decode-1")  # idempotent
