"""The engine-restarts counter that colocated and data-parallel clients register on the
server's metrics registry (the supervisor's work is the client's, not the server's)."""
from __future__ import annotations

from collections.abc import Callable

from prometheus_client.core import CounterMetricFamily

from deepinfer.wire.metric_prefix import PREFIX


class EngineRestartsCollector:
    """`deepinfer:engine_restarts_total`: engine processes started after the previous one died
    (colocated serving; the supervisor's work)."""

    def __init__(self, get_restarts: Callable[[], int], model_name: str) -> None:
        self.get_restarts = get_restarts
        self.model_name = model_name

    def collect(self):
        counter = CounterMetricFamily(PREFIX + "engine_restarts",
                                      "Engine processes restarted after a failure.",
                                      labels=["model_name"])
        counter.add_metric([self.model_name], self.get_restarts())
        yield counter
