"""deepinfer:wire_frames_dropped_total: the front's own drops plus those its engine / worker
processes report, summed by (channel, reason), never going down across an engine restart."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from deepinfer.clients.colocated import _add_counters
from deepinfer.wire.engine_messages import EngineStatsSnapshot
from deepinfer.server.wire_metrics import WireDropsCollector
from deepinfer.wire.drops import PROCESS_DROPS


def _samples(collector) -> dict[str, float]:
    registry = CollectorRegistry()
    registry.register(collector)
    out = {}
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith("deepinfer:wire_frames_dropped_total{"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_local_and_reported_drops_are_summed():
    before = PROCESS_DROPS.snapshot().get(("worker.output", "mac"), 0)
    PROCESS_DROPS.record("worker.output@tcp://127.0.0.1:1", "mac")
    remote = {"worker.output/mac": 2, "kv.pull/frames": 5, "junk": 1}
    samples = _samples(WireDropsCollector(lambda: remote))
    assert samples['deepinfer:wire_frames_dropped_total{channel="worker.output",reason="mac"}'] \
        == before + 3
    assert samples['deepinfer:wire_frames_dropped_total{channel="kv.pull",reason="frames"}'] == 5
    assert not any("junk" in k for k in samples)


def test_engine_restart_keeps_the_dead_engines_drops():
    dead = EngineStatsSnapshot(wire_frames_dropped={"engine.input/mac": 4})
    now = EngineStatsSnapshot(wire_frames_dropped={"engine.input/mac": 1,
                                                   "engine.input/replay": 2})
    total = _add_counters(dead, now)
    assert total.wire_frames_dropped == {"engine.input/mac": 5, "engine.input/replay": 2}
