"""The prefill worker and the shared store, on real engines (the session's model, fp32): the
real `PrefillWorkerLoop`, `SharedPrefixTier` and `KVPrefetcher` in this process, two workers
sharing one store, their loops stepped by hand instead of `run()` (so "between two chunks" is
a place the test can stop at, without sleeps or timing).

- per-chunk publishing: a long prompt's first full blocks are in the store, and served to the
  other worker, while its later chunks are still to compute;
- load or recompute under a slow store: a store read that outlives its budget (here one that
  hangs until the test ends) does not hold the request: it is admitted at the read's deadline
  and recomputed (same first token as the device-cached run), the read-timeout counter moves,
  and the next prompt skips the store altogether (loads-skipped moves, no read is started).
"""
from __future__ import annotations

import threading
import time

import pytest
import zmq

from deepinfer.cluster.kv_transport import ZmqKVTransport
from deepinfer.wire.worker_messages import PrefillRequest
from deepinfer.cluster.prefill_worker import STORE_PROBE_EVERY, PrefillWorkerLoop
from deepinfer.cluster.prefix_store_tier import SharedPrefixTier, layout_for_cache
from deepinfer.cluster.worker_spec import WorkerSpec
from deepinfer.core.prefix_hash import salt_hash
from deepinfer.kvstore.memory_store import MemoryKVBlockStore
from deepinfer.sampling_params import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
BS = 16
CHUNK = 32  # tokens per prefill step: two full blocks
DEADLINE_S = 60.0  # bound on any poll below (never reached when the code works)


class GatedStore(MemoryKVBlockStore):
    """A memory store whose reads hang until `gate` opens: a store slower than any
    recompute (a stuck NFS mount, a Redis timeout)."""

    def __init__(self, inner: MemoryKVBlockStore) -> None:
        super().__init__(inner.salt, inner.layout)
        self.inner = inner
        self.gate = threading.Event()
        self.num_reads_started = 0

    def _read(self, block_hash):
        self.num_reads_started += 1
        self.gate.wait(DEADLINE_S)
        return self.inner._read(block_hash)

    def _write(self, block_hash, data):
        self.inner._write(block_hash, data)

    def _exists(self, block_hash):
        return self.inner._exists(block_hash)

    def _delete(self, block_hash):
        self.inner._delete(block_hash)


@pytest.fixture
def workers(make_engine_llm):
    """make(store) -> a prefill worker over `store`; closed at teardown."""
    ctx = zmq.Context()
    sink = ctx.socket(zmq.PULL)
    sink.bind("inproc://store-reports")
    made = []

    def make(store, name):
        engine = make_engine_llm(num_kv_blocks=64, max_num_batched_tokens=CHUNK).engine
        assert engine.config.block_size == BS
        inbox, out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        out.connect("inproc://store-reports")
        transport = ZmqKVTransport(serve=True)
        layout = layout_for_cache(engine.cache)
        tier = SharedPrefixTier(store, engine.cache, engine.scheduler.kv, layout)
        spec = WorkerSpec(name, "prefill", engine.config, "inproc://unused",
                          "inproc://store-reports")
        worker = PrefillWorkerLoop(spec, engine, inbox, out, transport, tier)
        made.append((worker, inbox, out))
        return worker

    def store(salt_text="store-test"):
        return MemoryKVBlockStore(salt_hash(salt_text))

    yield make, store
    for worker, inbox, out in made:
        if isinstance(worker.tier.store, GatedStore):
            worker.tier.store.gate.set()
        worker.prefetcher.close()
        worker.tier.writer.close(timeout_s=5.0)
        worker.transport.close()
        inbox.close(linger=0)
        out.close(linger=0)
    sink.close(linger=0)
    ctx.term()


def step(worker) -> None:
    worker.before_step()
    if worker.has_step_work():
        worker.after_step(worker.engine.step())


def run_until_done(worker, request_id: str) -> int:
    """Step until `request_id` hands off; its first token."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        done = [d for d in worker._prefill_done if d.request_id == request_id]
        if done:
            worker.transport.unstage(request_id)  # as if a decode worker pulled it
            return done[0].first_token_id
        assert time.monotonic() < deadline, f"{request_id} did not finish"
        step(worker)


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.002)  # polling the writer thread's progress, bounded


def prompt(seed: int, n: int) -> list[int]:
    return [1000 + (seed * 7919 + i * 104729) % 20000 for i in range(n)]


def test_full_blocks_reach_the_store_per_chunk_and_serve_another_worker(workers):
    make, new_store = workers
    store = new_store()
    a, b = make(store, "prefill-a"), make(store, "prefill-b")
    long_prompt = prompt(1, 4 * BS + 5)  # 4 full blocks: 3 chunks (32, 32, 5 tokens)
    hashes = a.tier.block_hashes(long_prompt)
    a.handle(PrefillRequest("long", long_prompt, PARAMS, 0.0))
    deadline = time.monotonic() + DEADLINE_S
    while not a.engine.scheduler.requests.get("long"):  # its (empty) store read finishes
        assert time.monotonic() < deadline, "never admitted"
        a.before_step()
    request = a.engine.scheduler.requests["long"]
    step(a)  # the first chunk only
    assert request.num_computed_tokens == CHUNK < len(long_prompt)
    wait_until(lambda: store.contains(hashes[0]) and store.contains(hashes[1]),
               "the first chunk's blocks never reached the store")
    assert a.counters.store_blocks_published == 2
    assert not any(store.contains(h) for h in hashes[2:])  # not computed yet
    assert not a._prefill_done and "long" in a._prefilling  # the request is mid-prefill

    # The other worker reads those two blocks now, while "long" still computes on `a`.
    other = long_prompt[:2 * BS] + prompt(2, 20)
    b.handle(PrefillRequest("other", other, PARAMS, 0.0))
    first_b = run_until_done(b, "other")
    assert b.counters.store_hit_tokens == 2 * BS and b.counters.device_hit_tokens == 0
    assert a.engine.scheduler.requests["long"].num_computed_tokens < len(long_prompt)

    # Every full block is published by the end, and both runs are right: `a` computing
    # "other" after its own chunks gives the same first token as `b` loading them.
    run_until_done(a, "long")
    wait_until(lambda: all(store.contains(h) for h in hashes), "blocks missing at the end")
    assert a.counters.store_blocks_published == 4
    a.handle(PrefillRequest("other-a", other, PARAMS, 0.0))
    assert run_until_done(a, "other-a") == first_b


def test_a_hung_store_read_is_not_waited_for_and_the_next_prompt_skips_the_store(workers):
    make, new_store = workers
    store = new_store()
    a = make(store, "prefill-a")
    gated = GatedStore(store)
    b = make(gated, "prefill-b")
    shared = prompt(3, 5 * BS)
    a.handle(PrefillRequest("warm", shared + prompt(4, 9), PARAMS, 0.0))
    run_until_done(a, "warm")
    assert a.tier.writer.flush(DEADLINE_S)
    assert all(store.contains(h) for h in a.tier.block_hashes(shared))

    # b measures its compute rate on a prompt of its own (its read budget follows from it),
    # the store still answering; then the store hangs.
    gated.gate.set()
    b.handle(PrefillRequest("own", prompt(7, 17), PARAMS, 0.0))
    run_until_done(b, "own")
    assert b.compute_rate.num_samples > 0
    gated.gate.clear()
    gated.num_reads_started = 0
    # Loading q's 3 stored blocks is predicted cheap (the store's prior rate), but the read
    # hangs.
    q = shared[:3 * BS] + prompt(5, 8)
    b.handle(PrefillRequest("q", q, PARAMS, 0.0))
    report = b.load_report()  # q waits for its read: waiting load, but b's staging has room
    assert report.num_waiting_reqs == 1 and not b.engine.scheduler.requests
    assert report.kv_staged_bytes < report.kv_staging_capacity_bytes
    first_q = run_until_done(b, "q")  # before the fix: held until the gate opens
    assert gated.num_reads_started == 1 and not gated.gate.is_set()
    c = b.counters
    assert c.store_read_timeouts == 1 and c.store_hit_tokens == 0
    assert c.device_hit_tokens == 0  # all of q recomputed
    a.handle(PrefillRequest("q-a", q, PARAMS, 0.0))  # device-cached head on a
    assert run_until_done(a, "q-a") == first_q
    assert a.counters.device_hit_tokens >= 3 * BS

    # The hung read taught b that the store is dearer than recomputing: the next prompt
    # (device head 3 blocks, 2 more stored) skips it, no read is started, nothing is held.
    r = shared[:5 * BS] + prompt(6, 8)
    b.handle(PrefillRequest("r", r, PARAMS, 0.0))
    assert "r" not in b._jobs and not b._held
    assert c.store_loads_skipped == 1 and gated.num_reads_started == 1
    first_r = run_until_done(b, "r")
    assert c.store_hit_tokens == 0 and c.device_hit_tokens == 3 * BS
    a.handle(PrefillRequest("r-a", r, PARAMS, 0.0))
    assert run_until_done(a, "r-a") == first_r

    # Skipping is not for ever: every STORE_PROBE_EVERY-th prompt that would skip the store
    # reads it anyway, to notice a store that has recovered (only the read is started here).
    for i in range(STORE_PROBE_EVERY - 2):
        b._start_prefetch(PrefillRequest(f"s{i}", prompt(10 + i, 40), PARAMS, 0.0))
    assert c.store_loads_skipped == STORE_PROBE_EVERY - 1 and not b._jobs
    b._start_prefetch(PrefillRequest("probe", prompt(99, 40), PARAMS, 0.0))
    assert "probe" in b._jobs and c.store_loads_skipped == STORE_PROBE_EVERY - 1


def test_awaited_blocks_count_as_awaited_only_when_the_worker_waited_for_them(workers):
    # The router asks a worker to await blocks another is computing, and (briefly) blocks
    # just published. `store_await_tokens` counts those that arrived after a wait only.
    make, new_store = workers
    store = new_store()
    a, b, c = make(store, "prefill-a"), make(store, "prefill-b"), make(store, "prefill-c")
    head = prompt(3, 2 * BS + 3)  # 2 full blocks, computed on `a` after `b` starts waiting
    follow = head[:2 * BS] + prompt(4, 10)
    wait = {"num_await_blocks": 2, "await_timeout_s": DEADLINE_S}
    b.handle(PrefillRequest("waits", follow, PARAMS, 0.0, **wait))
    b.before_step()
    assert "waits" not in b.engine.scheduler.requests  # held while its read awaits them
    a.handle(PrefillRequest("head", head, PARAMS, 0.0))
    run_until_done(a, "head")
    first = run_until_done(b, "waits")
    assert b.counters.store_hit_tokens == 2 * BS and b.counters.store_await_tokens == 2 * BS
    c.handle(PrefillRequest("finds", follow, PARAMS, 0.0, **wait))  # published already
    assert run_until_done(c, "finds") == first
    assert c.counters.store_hit_tokens == 2 * BS and c.counters.store_await_tokens == 0
