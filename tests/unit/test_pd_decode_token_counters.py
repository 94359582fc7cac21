"""Decode worker counters of where a request's time between tokens goes: per step,
requests running vs requests given a token vs requests still waiting for their KV; per
admitted request, its wait split into allocation / pull / KV write / first step; the gaps
between a request's consecutive tokens on the worker. The loop is driven by hand on a fake
engine and transport, with a hand-set clock (no sockets, no model, no sleeps)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from deepinfer.cluster import decode_worker
from deepinfer.cluster.cluster_metrics import _COUNTERS
from deepinfer.cluster.decode_worker import DecodeWorkerLoop
from deepinfer.cluster.kv_transport import KVFetchResult
from deepinfer.wire.worker_messages import DecodeRequest, WorkerCounters
from deepinfer.sampling_params import SamplingParams
from deepinfer.wire.engine_messages import ChoiceDelta, RequestDelta


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


class FakeEngine:
    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.scheduler = SimpleNamespace(num_running=0)
        self.cache = SimpleNamespace(kv=torch.zeros(1), write_blocks=self._write)
        self.admitted: list[str] = []

    def _write(self, block_ids, kv) -> None:
        self.clock.now += 0.25  # the KV write takes a while

    def add_transferred_request(self, request_id, *args, **kwargs):
        return [0]

    def admit_transferred(self, request_id: str) -> None:
        self.admitted.append(request_id)
        self.scheduler.num_running += 1

    def abort_request(self, request_ids) -> None:
        pass

    def take_request_failures(self) -> list:
        return []


class FakeTransport:
    def __init__(self) -> None:
        self.fetching: list[str] = []
        self.done: list[KVFetchResult] = []

    def fetch(self, request_id, addr, timeout_s) -> None:
        self.fetching.append(request_id)

    def poll(self) -> list[KVFetchResult]:
        done, self.done = self.done, []
        return done

    def cancel_fetch(self, request_id) -> None:
        pass


class IdentityTracker:
    """Steps here return `RequestDelta`s already."""

    def add_request(self, *args) -> None:
        pass

    def resume(self, *args, **kwargs) -> None:
        pass

    def to_delta(self, output):
        return output


def decode_request(request_id: str) -> DecodeRequest:
    return DecodeRequest(request_id, [1, 2, 3], SamplingParams(max_tokens=8), 0.0, 7, None, 1,
                         "tcp://p", 100)


def token(request_id: str, finished: bool = False) -> RequestDelta:
    return RequestDelta(request_id, [ChoiceDelta(0, "x", [5])], finished)


@pytest.fixture
def worker(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(decode_worker, "time", clock)
    spec = SimpleNamespace(transfer_timeout_s=10.0, debug_transfer_delay_s=0.0, kv_store_url=None,
                           input_addr="inproc://decode-in", output_addr="inproc://decode-out")
    loop = DecodeWorkerLoop(spec, FakeEngine(clock), None, None, FakeTransport())
    loop.tracker = IdentityTracker()
    return loop, clock


def arrive_pull_admit(loop, clock, request_id: str) -> None:
    """Received at t, allocated 0.5 s later, pulled 2 s after that, written in 0.25 s."""
    loop.handle(decode_request(request_id))
    clock.now += 0.5
    loop.before_step()  # allocates, starts the pull
    assert request_id in loop.transport.fetching
    clock.now += 2.0
    loop.transport.done.append(KVFetchResult(request_id, torch.zeros(1), 100, 1.5))
    loop.before_step()  # writes the KV, admits


def test_decode_counters_split_the_wait_and_count_token_gaps(worker):
    loop, clock = worker
    arrive_pull_admit(loop, clock, "a")
    assert loop.engine.admitted == ["a"]
    clock.now += 0.1
    loop.after_step([token("a")])  # a's first token here, 0.1 s after admission
    loop.handle(decode_request("b"))  # b waits for its KV while a steps
    loop.before_step()  # allocates b, starts its pull
    clock.now += 0.04
    loop.after_step([token("a")])
    loop.before_step()
    clock.now += 0.06
    loop.after_step([token("a", finished=True)])
    c = loop.counters
    assert c.decode_alloc_wait_seconds_total == pytest.approx(0.5)
    assert c.decode_fetch_wait_seconds_total == pytest.approx(2.0)
    assert c.decode_kv_write_seconds_total == pytest.approx(0.25)
    assert c.decode_first_token_wait_seconds_total == pytest.approx(0.1)
    assert c.decode_admitted == 1
    assert c.decode_token_gaps == 2
    assert c.decode_token_gap_seconds_total == pytest.approx(0.1)
    assert c.decode_step_running_requests == 3
    assert c.decode_step_token_requests == 3
    assert c.decode_step_pending_transfers == 2  # b, during a's second and third steps


def test_a_running_request_without_a_token_is_counted(worker):
    loop, clock = worker
    arrive_pull_admit(loop, clock, "a")
    arrive_pull_admit(loop, clock, "b")
    loop.after_step([token("a"), token("b")])
    loop.before_step()
    clock.now += 0.03
    loop.after_step([token("a")])  # b got nothing this step
    loop.before_step()
    clock.now += 0.03
    loop.after_step([token("a"), token("b")])
    c = loop.counters
    assert c.decode_step_running_requests == 6
    assert c.decode_step_token_requests == 5
    assert c.decode_token_gaps == 3  # a twice, b once (over two steps)
    assert c.decode_token_gap_seconds_total == pytest.approx(0.03 + 0.03 + 0.06)
    # step walls x requests served: the first step took no time, then 2 x 0.03, 1 x 0.03
    assert c.decode_step_token_seconds_total == pytest.approx(0.03 + 2 * 0.03)


def test_an_aborted_request_leaves_no_times_behind(worker):
    from deepinfer.wire.worker_messages import AbortRequests
    loop, clock = worker
    arrive_pull_admit(loop, clock, "a")
    loop.after_step([token("a")])
    loop.handle(AbortRequests(["a"]))
    assert not loop._last_token_at and not loop._admitted_at


def test_decode_counters_are_exported_per_worker():
    names = {name for name, _, _ in _COUNTERS}
    counters = WorkerCounters(decode_step_running_requests=6, decode_token_gaps=3,
                              decode_token_gap_seconds_total=0.5, decode_admitted=2)
    values = {name: get(counters) for name, _, get in _COUNTERS}
    for name in ("decode_step_running_requests", "decode_step_token_requests",
                 "decode_step_token_seconds",
                 "decode_step_pending_transfers", "decode_token_gap_seconds",
                 "decode_token_gaps", "decode_alloc_wait_seconds", "decode_fetch_wait_seconds",
                 "decode_kv_write_seconds", "decode_first_token_wait_seconds",
                 "decode_admitted_requests", "between_steps_seconds"):
        assert name in names
    assert values["decode_step_running_requests"] == 6
    assert values["decode_token_gap_seconds"] == 0.5
    assert values["decode_admitted_requests"] == 2
