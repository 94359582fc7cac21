"""EncodeStage at the front, with its worker processes replaced by sockets the test reads: a
request goes to the least-loaded encode worker, its EncodeDone (in a report) finishes it, a
failed encode is a ValueError, and a lost worker's request is sent once to another worker."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
import zmq
import zmq.asyncio

from deepinfer.wire.encode_messages import (EncodeCounters, EncodeDone, EncodeImages,
                                               EncodeWorkerReport)
from deepinfer.cluster.encode_stage import EncodeStage, EncodeStageConfig, _EncodeWorker
from deepinfer.cluster.encode_worker import EncodeWorkerSpec
from deepinfer.cluster.worker_channels import bind_worker_input
from deepinfer.wire.mm_inputs import ImagePlaceholder, MultiModalInputs, PixelArray
from deepinfer.engine.exceptions import EngineDeadError
from deepinfer.wire.channel import ChannelReceiver, channel_name
from tests.unit.hello_fakes import hello_dealer


def mm(*hashes: str) -> MultiModalInputs:
    pixels = PixelArray.from_numpy(np.zeros((3, 2, 2), dtype=np.float32))
    return MultiModalInputs([ImagePlaceholder(h, 10 * i, 5) for i, h in enumerate(hashes)],
                            [pixels] * len(hashes))


class Stage:
    """An EncodeStage whose two 'workers' are DEALER sockets in this test (said hello)."""

    def __init__(self):
        self.stage = EncodeStage(None, EncodeStageConfig(num_workers=2, kv_store_url="fs"))
        self.ctx = zmq.Context()
        self.inboxes = {}
        for i in range(2):
            sock = bind_worker_input(self.stage._ctx, "127.0.0.1", f"encode-{i}")
            spec = EncodeWorkerSpec(f"encode-{i}", None, sock.address, "")
            self.stage.workers[spec.worker_id] = _EncodeWorker(spec, sock, ready=True)
            self.stage.supervisor.add_worker(spec.worker_id, "encode", 0.0)
        self.decoders = {wid: ChannelReceiver(channel_name("worker.input", w.spec.input_addr),
                                              EncodeImages)
                         for wid, w in self.stage.workers.items()}

    async def connect(self) -> None:
        for wid, w in self.stage.workers.items():
            self.inboxes[wid] = await hello_dealer(self.ctx, wid, w.spec.input_addr)

    async def received(self, worker_id: str) -> EncodeImages:
        inbox = self.inboxes[worker_id]
        assert await asyncio.to_thread(inbox.poll, 5000), f"nothing sent to {worker_id}"
        return self.decoders[worker_id].decode_or_raise(inbox.recv())

    def report(self, worker_id: str, done=(), images: int = 0, patches: int = 0) -> None:
        self.stage._on_report(EncodeWorkerReport(worker_id, images, patches, EncodeCounters(), list(done)))

    def close(self):
        for inbox in self.inboxes.values():
            inbox.close(linger=0)
        self.ctx.term()


def run(coro_fn):
    async def main():
        stage = Stage()
        try:
            await stage.connect()
            return await coro_fn(stage)
        finally:
            stage.close()
            await stage.stage.shutdown()
    return asyncio.run(main())


def test_request_goes_to_least_loaded_worker_and_finishes_on_its_done():
    async def go(s: Stage):
        s.report("encode-0", patches=5000, images=4)
        s.report("encode-1", patches=10, images=1)
        task = asyncio.create_task(s.stage.encode("r1", mm("a", "b")))
        msg = await s.received("encode-1")
        assert msg.image_hashes == ["a", "b"] and msg.num_patches == 10
        s.report("encode-0", done=[EncodeDone("r1", 2)])  # not the worker it went to: ignored
        await asyncio.sleep(0.05)
        assert not task.done()
        s.report("encode-1", done=[EncodeDone("r1", 2, encode_s=0.4)])
        done = await task
        assert done.num_images == 2 and s.stage.encode_time.count == 1
        assert abs(s.stage.encode_time.sum - 0.2) < 1e-9 and s.stage.images_per_request.count == 1
    run(go)


def test_failed_encode_is_a_value_error():
    async def go(s: Stage):
        task = asyncio.create_task(s.stage.encode("bad", mm("x")))
        msg = await s.received("encode-0")
        s.report("encode-0", done=[EncodeDone(msg.request_id, 1, error="image encoding failed: boom")])
        with pytest.raises(ValueError, match="boom"):
            await task
    run(go)


def test_lost_worker_request_goes_once_to_another():
    async def go(s: Stage):
        task = asyncio.create_task(s.stage.encode("r", mm("a")))
        await s.received("encode-0")
        await s.stage._on_worker_lost("encode-0", "process exited (-9)")
        await s.received("encode-1")  # sent again
        s.report("encode-1", done=[EncodeDone("r", 1)])
        assert (await task).request_id == "r"
        assert s.stage.num_lost == 1 and s.stage.is_healthy
        task = asyncio.create_task(s.stage.encode("r2", mm("b")))
        await s.received("encode-1")
        await s.stage._on_worker_lost("encode-1", "process exited (1)")
        with pytest.raises(EngineDeadError, match="no encode worker available"):
            await task
        assert not s.stage.is_healthy
    run(go)


def test_images_without_pixels_cannot_be_encoded():
    async def go(s: Stage):
        with pytest.raises(ValueError, match="without pixel values"):
            await s.stage.encode("r", mm("a").without_pixels())
    run(go)


class FakeProc:
    def __init__(self, pid: int):
        self.pid, self.exitcode, self.alive = pid, None, True

    def is_alive(self):
        return self.alive

    def kill(self):
        self.alive, self.exitcode = False, -9

    def join(self, timeout=None):
        self.alive = False


def test_lost_worker_is_restarted_and_routed_to_once_ready():
    from deepinfer.wire.encode_messages import EncodeWorkerReady

    async def go(s: Stage):
        stage = s.stage
        pids = iter(range(1000, 2000))

        def spawn(worker):
            worker.proc = FakeProc(next(pids))
        stage._spawn = spawn
        for w in stage.workers.values():
            w.proc = FakeProc(next(pids))
        stage.workers["encode-0"].proc.kill()
        import time
        now = time.monotonic()
        await stage._check_workers(now)  # exited: lost, restart after the back-off
        assert not stage.workers["encode-0"].alive and stage.num_lost == 1
        await stage._check_workers(now + 5.0)  # due: a new process
        new_pid = stage.workers["encode-0"].proc.pid
        assert stage.supervisor.num_restarts["encode"] == 1
        assert not stage.workers["encode-0"].socket.bound  # the old connection is released
        s.inboxes["encode-0"].close(linger=0)  # the new process says hello on its own
        s.inboxes["encode-0"] = await hello_dealer(s.ctx, "encode-0",
                                                   stage.workers["encode-0"].spec.input_addr)
        stage._on_restarted(EncodeWorkerReady("encode-0", new_pid - 1, True))  # stale: ignored
        assert not stage.workers["encode-0"].alive
        stage._on_restarted(EncodeWorkerReady("encode-0", new_pid, True))
        assert stage.workers["encode-0"].alive
        s.report("encode-1", patches=10_000, images=9)
        task = asyncio.create_task(stage.encode("r", mm("a")))
        await s.received("encode-0")  # routable again, and the least loaded
        s.report("encode-0", done=[EncodeDone("r", 1)])
        await task
    run(go)
