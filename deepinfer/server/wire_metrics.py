"""`deepinfer:wire_frames_dropped_total{channel,reason}`: frames between processes that failed
authentication or validation and were dropped -- the front's own, plus the counts its engine
and worker processes last reported in their stats (`wire_frames_dropped`)."""
from __future__ import annotations

from collections.abc import Callable

from prometheus_client.core import CounterMetricFamily

from deepinfer.wire.drops import PROCESS_DROPS, merge_reports


class WireDropsCollector:
    def __init__(self, get_remote_reports: Callable[[], dict[str, int]]) -> None:
        self.get_remote_reports = get_remote_reports

    def totals(self) -> dict[tuple[str, str], int]:
        local = {f"{c}/{r}": n for (c, r), n in PROCESS_DROPS.snapshot().items()}
        return merge_reports(local, self.get_remote_reports() or {})

    def collect(self):
        counter = CounterMetricFamily(
            "deepinfer:wire_frames_dropped", "Frames between DeepInfer processes dropped "
            "unread (bad MAC, replay, oversize, undecodable, wrong type...).",
            labels=["channel", "reason"])
        for (channel, reason), count in sorted(self.totals().items()):
            counter.add_metric([channel, reason], count)
        yield counter
