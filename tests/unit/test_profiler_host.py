"""`deepinfer profile`'s host measurements: the engine loop's time outside the model runner
(fake engine on a fake clock, so the fit is checked exactly) and the KV transport path (the
real ZMQ transport over loopback, a small fake cache)."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from deepinfer.cluster.kv_transport import ZmqKVTransport
from deepinfer.runtime.profiler import (_fit_line, measure_host_overhead, measure_kv_transport,
                                        measure_store_publish)

PER_STEP_S, PER_REQUEST_S, MODEL_S = 0.004, 0.0003, 0.05


class FakeEngine:
    """Each decode step takes MODEL_S in the runner plus PER_STEP_S + PER_REQUEST_S · B of
    loop work on the fake clock; prefill steps cost a round second (not measured)."""

    def __init__(self) -> None:
        self.t = 0.0
        self.model_config = SimpleNamespace(vocab_size=1000)
        self.scheduler = SimpleNamespace(requests={})
        self._last = 0.0

    def clock(self) -> float:
        return self.t

    def add_request(self, request_id, prompt_token_ids, params) -> None:
        assert params.ignore_eos and params.max_tokens > 0
        self.scheduler.requests[request_id] = SimpleNamespace(
            num_computed_tokens=0, prompt_len=len(prompt_token_ids))

    def step(self) -> list:
        reqs = self.scheduler.requests.values()
        if any(r.num_computed_tokens < r.prompt_len for r in reqs):
            for r in reqs:
                r.num_computed_tokens = r.prompt_len
            self._last, self.t = 1.0, self.t + 1.0
            return []
        self._last = MODEL_S
        self.t += MODEL_S + PER_STEP_S + PER_REQUEST_S * len(reqs)
        return [object()] * len(reqs)

    def get_stats(self):
        return SimpleNamespace(step_time_s=self._last)

    def abort_request(self, request_ids) -> None:
        for request_id in request_ids:
            self.scheduler.requests.pop(request_id)


def test_host_overhead_is_step_wall_minus_runner_time_fitted_per_request():
    engine = FakeEngine()
    seen = []
    host = measure_host_overhead(engine, batch_sizes=(1, 8, 32), num_steps=4,
                                 after_step=seen.append, clock=engine.clock)
    assert host["per_step_s"] == pytest.approx(PER_STEP_S)
    assert host["per_request_s"] == pytest.approx(PER_REQUEST_S)
    assert [b for b, _ in host["samples"]] == [1, 8, 32]
    assert len(seen) == 3 * 4  # the serving loop's work ran after every measured step
    assert not engine.scheduler.requests  # its requests are gone again


def test_fit_line_clips_negative_parts():
    assert _fit_line([(1, 2.0), (3, 4.0)]) == pytest.approx((1.0, 1.0))
    assert _fit_line([(1, 3.0), (3, 1.0)]) == pytest.approx((2.0, 0.0))  # slope < 0: flat
    assert _fit_line([(4, 0.5)]) == pytest.approx((0.5, 0.0))


class FakeCache:
    def __init__(self) -> None:
        self.kv = torch.arange(2 * 64 * 16 * 8, dtype=torch.float32).reshape(2, 64, 16, 8)
        self.num_blocks = 64
        self.spec = SimpleNamespace(bytes_per_block=2 * 16 * 8 * 4)
        self.written = []

    def read_blocks(self, block_ids):
        return self.kv[:, block_ids].clone()

    def write_blocks(self, block_ids, data) -> None:
        assert torch.equal(data, self.kv[:, block_ids])  # what arrived is what was staged
        self.written.append(len(block_ids))


def test_kv_transport_moves_staged_blocks_over_the_real_transport():
    engine = SimpleNamespace(cache=FakeCache(), config=SimpleNamespace(block_size=16))
    link = measure_kv_transport(engine, lambda serve: ZmqKVTransport(serve=serve),
                                token_counts=(64, 512), num_repeats=2)
    assert engine.cache.written == [4, 4, 32, 32]
    assert [n for n, _ in link["samples"]] == [4 * 1024, 32 * 1024]  # bytes per size
    assert link["bandwidth_gb_s"] > 0 and link["latency_ms"] >= 0


class BurningCache(FakeCache):
    """Staging and writing burn a known CPU time per byte on the calling thread."""

    # 1 and 2 ms per KiB: even the 4 KiB transfer burns 4 ms, well above the noise of the
    # process's other threads (at 0.4 ms the fitted slope could fall below the burnt rate).
    SEND_S_PER_BYTE, RECV_S_PER_BYTE = 1e-6, 2e-6

    @staticmethod
    def _burn(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    def read_blocks(self, block_ids):
        self._burn(self.SEND_S_PER_BYTE * len(block_ids) * self.spec.bytes_per_block)
        return super().read_blocks(block_ids)

    def write_blocks(self, block_ids, data) -> None:
        self._burn(self.RECV_S_PER_BYTE * len(block_ids) * self.spec.bytes_per_block)
        super().write_blocks(block_ids, data)


def test_kv_transport_reports_each_ends_cpu_per_gb():
    engine = SimpleNamespace(cache=BurningCache(), config=SimpleNamespace(block_size=16))
    # One torch thread, as `sim_validation` profiles: idle OpenMP threads spin-waiting after
    # a parallel copy would count as the transport's CPU.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        link = measure_kv_transport(engine, lambda serve: ZmqKVTransport(serve=serve),
                                    token_counts=(64, 512), num_repeats=3)
    finally:
        torch.set_num_threads(threads)
    cpu = link["cpu_s_per_gb"]
    # The burnt CPU per byte, plus (never minus) half the transport threads' each.
    assert 0.9 * 1000 <= cpu["sender"] <= 2.0 * 1000
    assert 0.9 * 2000 <= cpu["receiver"] <= 2.0 * 2000
    assert [n for n, _, _ in link["cpu_samples"]] == [4 * 1024, 32 * 1024]


def test_store_publish_is_cpu_seconds_per_byte_of_the_prompts_blocks():
    engine = SimpleNamespace(cache=FakeCache(), config=SimpleNamespace(block_size=16))
    seen, flushed = [], []
    publish = measure_store_publish(engine, lambda kv: seen.append(kv.shape[1]),
                                    lambda: flushed.append(True), num_tokens=100,
                                    num_repeats=3)
    assert seen == [7, 7, 7] and len(flushed) == 3  # ceil(100 / 16) blocks, every repeat
    assert publish["num_bytes"] == 7 * 1024
    assert publish["s_per_byte"] == pytest.approx(publish["cpu_s"] / (7 * 1024))


@pytest.mark.slow  # starts processes
def test_host_sharing_table_starts_at_one_process_alone():
    from deepinfer.bench.host_contention import measure_host_sharing
    sharing = measure_host_sharing(max_procs=2, duration_s=0.2, size=64)
    assert sharing["speed"][0] == 1.0 and len(sharing["speed"]) == 2
    assert sharing["speed"][1] > 0
