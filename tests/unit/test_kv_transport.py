"""`ZmqKVTransport` over real sockets on 127.0.0.1 (no model): a dead or hung source holds up
only its own pulls; cancelled pulls are dropped; payloads round-trip exactly."""
from __future__ import annotations

import time

import pytest
import torch
import zmq

from deepinfer.cluster.kv_transport import ZmqKVTransport

pytestmark = pytest.mark.timeout(60)


def wait_results(transport, want: set[str], timeout: float = 20.0) -> dict:
    """Poll until results for every id in `want` arrived (bounded)."""
    got = {}
    deadline = time.monotonic() + timeout
    while not want <= set(got):
        if time.monotonic() > deadline:
            raise AssertionError(f"no result for {sorted(want - set(got))} within {timeout} s "
                                 f"(have {sorted(got)})")
        got.update({r.request_id: r for r in transport.poll()})
        time.sleep(0.01)
    return got


def wait_until(predicate, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


@pytest.fixture
def hung_source():
    """A bound ROUTER that never answers: a prefill worker that is stopped or hung."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield f"tcp://127.0.0.1:{port}"
    sock.close(linger=0)
    ctx.term()


@pytest.fixture
def pair():
    prefill = ZmqKVTransport(serve=True)
    decode = ZmqKVTransport(serve=False)
    yield prefill, decode
    decode.close()
    prefill.close()


def test_payload_round_trips_and_unstaged_is_a_clear_error(pair):
    prefill, decode = pair
    kv = torch.randn(2, 2, 3, 4, 1, 8).to(torch.bfloat16)
    assert prefill.stage("a", kv, ttl_s=60) == kv.numel() * 2
    prefill.stage("b", kv, ttl_s=60)
    prefill.unstage("b")
    decode.fetch("a", prefill.address, timeout_s=20)
    decode.fetch("b", prefill.address, timeout_s=20)
    got = wait_results(decode, {"a", "b"})
    assert got["a"].error is None and torch.equal(got["a"].kv, kv)
    assert "not staged" in got["b"].error
    assert prefill.stats().num_staged == 0 and decode.stats().num_received == 1


def test_a_hung_source_does_not_block_pulls_from_other_sources(pair, hung_source):
    prefill, decode = pair
    kv = torch.arange(48, dtype=torch.float32).reshape(1, 2, 1, 3, 1, 8)
    decode.fetch("stuck", hung_source, timeout_s=45)  # first in line
    for i in range(3):
        prefill.stage(f"live-{i}", kv + i, ttl_s=60)
        decode.fetch(f"live-{i}", prefill.address, timeout_s=45)
    # A serial fetcher would wait out the stuck pull's 45 s timeout before these.
    got = wait_results(decode, {"live-0", "live-1", "live-2"}, timeout=20)
    assert all(torch.equal(got[f"live-{i}"].kv, kv + i) for i in range(3))
    assert "stuck" not in got and decode.num_fetching() == 1
    # Its source is known dead: cancelling drops the pull at once, and no result follows.
    decode.cancel_fetch("stuck")
    wait_until(lambda: decode.num_fetching() == 0, "the cancelled pull to be dropped")
    assert decode.poll() == []


def test_each_pull_has_its_own_deadline(pair, hung_source):
    prefill, decode = pair
    kv = torch.ones(1, 2, 1, 2, 1, 4)
    decode.fetch("slow", hung_source, timeout_s=0.3)
    prefill.stage("fast", kv, ttl_s=60)
    decode.fetch("fast", prefill.address, timeout_s=30)
    got = wait_results(decode, {"slow", "fast"})
    assert got["slow"].error == "KV transfer timed out" and got["slow"].kv is None
    assert got["fast"].error is None
    assert decode.stats().num_failed == 1


def test_a_result_that_arrives_after_cancel_is_dropped(pair):
    prefill, decode = pair
    prefill.stage("x", torch.zeros(1, 2, 1, 2, 1, 4), ttl_s=60)
    decode.fetch("x", prefill.address, timeout_s=30)
    wait_until(lambda: prefill.stats().num_sent == 1, "the payload to be sent")
    decode.cancel_fetch("x")
    wait_until(lambda: decode.num_fetching() == 0, "nothing in flight")
    assert decode.poll() == []
