"""P/D workers report where their time goes (steps, the runner's seconds, the loop's wall
seconds around them, process CPU seconds) so the simulator's validation can compare a real
decode worker's steps with the simulated ones; the front exposes them per worker."""
from __future__ import annotations

import time
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest

from deepinfer.cluster.cluster_metrics import ClusterCollector
from deepinfer.wire.worker_messages import WorkerCounters, WorkerLoadReport
from deepinfer.cluster.worker_loop import WorkerLoop
from deepinfer.engine.engine_config import EngineConfig
from deepinfer.cluster.worker_spec import WorkerSpec


class FakeEngine:
    def __init__(self, num_steps: int, model_s: float) -> None:
        self.left, self.model_s = num_steps, model_s
        self.num_failed_steps = self.num_failed_requests = 0

    def has_unfinished_requests(self) -> bool:
        return self.left > 0

    def step(self) -> list:
        self.left -= 1
        return []

    def get_stats(self):
        return SimpleNamespace(step_time_s=self.model_s)

    def take_request_failures(self) -> list:
        return []


class CountingLoop(WorkerLoop):
    """The real loop; inputs never arrive, reports are kept instead of sent."""

    def __init__(self, engine, iterations: int) -> None:
        spec = WorkerSpec("decode-0", "decode", EngineConfig(), "tcp://x:1", "tcp://x:2")
        super().__init__(spec, engine, None, None)
        self.iterations, self.reports = iterations, []

    def _drain_inputs(self, timeout_ms: int) -> bool:
        self.iterations -= 1
        return self.iterations >= 0

    def send_report(self) -> None:
        self.reports.append(self.counters.num_engine_steps)
        self._dirty = False


def test_worker_loop_counts_steps_and_model_and_loop_seconds():
    loop = CountingLoop(FakeEngine(num_steps=5, model_s=0.25), iterations=8)
    loop.run()
    c = loop.counters
    assert c.num_engine_steps == 5  # idle iterations are not steps
    assert c.model_step_seconds_total == 5 * 0.25
    assert 0.0 < c.loop_step_seconds_total < 5 * 0.25  # real wall time of a no-op step


def test_real_report_carries_process_cpu_seconds():
    loop = WorkerLoop(WorkerSpec("decode-0", "decode", EngineConfig(), "tcp://x:1", "tcp://x:2"),
                      FakeEngine(0, 0.0), None, SimpleNamespace(send=lambda *a, **k: None))
    loop.load_report = lambda: WorkerLoadReport(0, 0, 0, 0, 100, 16, 0, 8)
    sum(i * i for i in range(200_000))  # some CPU in this process
    loop.send_report()
    assert loop.counters.process_cpu_seconds > 0.0


def test_front_exposes_the_timing_per_worker():
    counters = WorkerCounters(num_engine_steps=7, model_step_seconds_total=1.5,
                              loop_step_seconds_total=2.0, process_cpu_seconds=3.25)
    handle = SimpleNamespace(worker_id="decode-1", role="decode", alive=True, counters=counters,
                             last_report=WorkerLoadReport(0, 0, 0, 0, 100, 16, 0, 8))
    client = SimpleNamespace(
        workers={"decode-1": handle},
        prefill_router=SimpleNamespace(num_routed={}, name="p", num_staging_full=0),
        decode_router=SimpleNamespace(num_routed={}, name="d"),
        health=SimpleNamespace(num_retried=0, num_failed_by_worker_loss=0, num_suspended=0),
        supervisor=SimpleNamespace(num_restarts={"prefill": 0, "decode": 0},
                                   num_gave_up={"prefill": 0, "decode": 0}))
    registry = CollectorRegistry()
    registry.register(ClusterCollector(client))
    text = generate_latest(registry).decode()
    labels = '{role="decode",worker_id="decode-1"}'
    for name, value in (("engine_steps_total", "7.0"), ("model_step_seconds_total", "1.5"),
                        ("loop_step_seconds_total", "2.0"),
                        ("process_cpu_seconds_total", "3.25")):
        assert f"deepinfer:cluster_{name}{labels} {value}" in text, name


class BusyEngine(FakeEngine):
    def step(self) -> list:
        sum(i * i for i in range(100_000))  # CPU inside the step
        return super().step()


class WaitingLoop(CountingLoop):
    """Each idle wait for input takes ~20 ms of wall time (a poll that returns nothing)."""

    def _drain_inputs(self, timeout_ms: int) -> bool:
        if timeout_ms:
            deadline = time.perf_counter() + 0.02
            while time.perf_counter() < deadline:
                pass
        return super()._drain_inputs(timeout_ms)


def test_worker_loop_counts_cpu_in_steps_and_idle_waits():
    """Where a worker's wall time goes: CPU inside steps (steps' wall - this = descheduled
    or blocked) and waits for input with nothing to step; busy polls are not idle."""
    loop = WaitingLoop(BusyEngine(num_steps=3, model_s=0.0), iterations=6)
    loop.run()
    c = loop.counters
    assert c.model_step_cpu_seconds_total > 0.0
    # 3 busy iterations poll with timeout 0; the 3 idle ones wait ~20 ms each
    assert 0.06 <= c.idle_wait_seconds_total < 1.0


def test_front_exposes_where_the_time_and_prefills_went():
    counters = WorkerCounters(model_step_cpu_seconds_total=1.25, idle_wait_seconds_total=0.5,
                              num_prefilled_requests=3, prefill_computed_tokens=700)
    handle = SimpleNamespace(worker_id="prefill-0", role="prefill", alive=True,
                             counters=counters,
                             last_report=WorkerLoadReport(0, 0, 0, 0, 100, 16, 0, 8))
    client = SimpleNamespace(
        workers={"prefill-0": handle},
        prefill_router=SimpleNamespace(num_routed={}, name="p", num_staging_full=0),
        decode_router=SimpleNamespace(num_routed={}, name="d"),
        health=SimpleNamespace(num_retried=0, num_failed_by_worker_loss=0, num_suspended=0),
        supervisor=SimpleNamespace(num_restarts={"prefill": 0, "decode": 0},
                                   num_gave_up={"prefill": 0, "decode": 0}))
    registry = CollectorRegistry()
    registry.register(ClusterCollector(client))
    text = generate_latest(registry).decode()
    labels = '{role="prefill",worker_id="prefill-0"}'
    for name, value in (("model_step_cpu_seconds_total", "1.25"),
                        ("idle_wait_seconds_total", "0.5"), ("prefilled_requests_total", "3.0"),
                        ("prefill_computed_tokens_total", "700.0")):
        assert f"deepinfer:cluster_{name}{labels} {value}" in text, name
