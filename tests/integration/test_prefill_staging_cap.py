"""A prefill worker's staged host memory is capped: prompts whose KV would not fit next to
what is staged and promised wait in the worker (FIFO), the load report says its staging is
full (the prefill router's back-pressure), and they run as decode workers pull. The real
`PrefillWorkerLoop` and `ZmqKVTransport` in this process on the session's model; the loop is
stepped by hand instead of `run()`."""
from __future__ import annotations

import pytest
import zmq

from deepinfer.cluster.kv_transport import ZmqKVTransport
from deepinfer.wire.worker_messages import PrefillRequest
from deepinfer.cluster.prefill_worker import PrefillWorkerLoop
from deepinfer.cluster.worker_spec import WorkerSpec
from deepinfer.sampling_params import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture
def loop(make_engine_llm):
    engine = make_engine_llm(num_kv_blocks=64).engine
    bytes_per_block = engine.cache.spec.bytes_per_block
    ctx = zmq.Context()
    inbox, out, sink = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    sink.bind("inproc://reports")
    out.connect("inproc://reports")
    transport = ZmqKVTransport(serve=True)
    # Room for one 40-token prompt (3 blocks of 16) and a bit: never two at once.
    spec = WorkerSpec("prefill-t", "prefill", engine.config, "inproc://unused",
                      "inproc://reports", max_staged_bytes=4 * bytes_per_block)
    worker = PrefillWorkerLoop(spec, engine, inbox, out, transport, tier=None)
    yield worker, bytes_per_block
    transport.close()
    for sock in (inbox, out, sink):
        sock.close(linger=0)
    ctx.term()


def step(worker) -> None:
    worker.before_step()
    if worker.has_step_work():
        worker.after_step(worker.engine.step())


def test_staging_stays_under_the_cap_and_held_prompts_run_as_kv_is_pulled(loop):
    worker, bytes_per_block = loop
    cap = worker.staging.capacity_bytes
    for i in range(3):
        worker.handle(PrefillRequest(f"s{i}", [100 + i] * 40, PARAMS, 0.0))
    report = worker.load_report()
    assert report.num_waiting_reqs >= 2 and report.kv_staged_bytes >= cap  # full: look elsewhere
    staged_ids: list[str] = []
    for _ in range(200):
        step(worker)
        staged = worker.transport.stats()
        assert staged.staged_bytes <= cap  # never more than the cap in host memory
        done = [d.request_id for d in worker._prefill_done if d.request_id not in staged_ids]
        staged_ids += done
        for request_id in done:
            assert staged.num_staged == 1  # the next one waits until this one is pulled
            worker.transport.unstage(request_id)  # a decode worker pulled it
        if len(staged_ids) == 3:
            break
    assert staged_ids == ["s0", "s1", "s2"]  # FIFO
    report = worker.load_report()
    assert report.kv_staged_bytes == 0 and report.num_waiting_reqs == 0
    assert report.kv_staging_capacity_bytes == cap == 4 * bytes_per_block
