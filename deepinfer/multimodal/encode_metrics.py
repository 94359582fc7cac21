"""Prometheus metrics of the encode stage (E/P/D), named like vLLM's with `deepinfer:encode_*`:
queue per encode worker, encode time per image, embedding-cache hits by tier, images per
request. Read from the stage's latest worker reports at scrape time."""
from __future__ import annotations

import bisect

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

PREFIX = "deepinfer:encode_"
ENCODE_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
IMAGES_PER_REQUEST_BUCKETS = (1, 2, 3, 4, 6, 8, 16)


class BucketCounts:
    """A histogram's state without prometheus (bounded memory): counts per upper bound."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, int]]:
        out, total = [], 0
        for bound, n in zip([*map(str, self.buckets), "+Inf"], self.counts):
            total += n
            out.append((bound, total))
        return out


class EncodeCollector:
    def __init__(self, stage) -> None:
        self.stage = stage

    def collect(self):
        workers = list(self.stage.workers.values())
        labels = ["worker_id"]
        for name, doc, get in (
                ("worker_up", "1 while the encode worker is routable.", lambda w: int(w.alive)),
                ("queue_images", "Images queued on the encode worker.", lambda w: w.num_queued_images),
                ("queue_patches", "Image patches (vision tokens) queued on the encode worker.",
                 lambda w: w.num_queued_patches)):
            family = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            for w in workers:
                family.add_metric([w.worker_id], get(w))
            yield family
        for name, doc, get in (
                ("images", "Images asked of the encode worker.", lambda c: c.num_images),
                ("images_encoded", "Images run through the vision tower.", lambda c: c.num_images_encoded),
                ("batches", "Vision-tower batches.", lambda c: c.num_batches),
                ("seconds", "Time in the vision tower.", lambda c: c.encode_seconds_total),
                ("cache_misses", "Images not in any embedding cache tier.", lambda c: c.misses),
                ("failed_requests", "Encode requests that failed.", lambda c: c.num_failed)):
            family = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            for w in workers:
                family.add_metric([w.worker_id], get(w.counters))
            yield family
        hits = CounterMetricFamily(PREFIX + "cache_hits", "Images whose embeddings were cached, "
                                   "by tier (local: the worker's LRU; store: the shared store).",
                                   labels=["worker_id", "tier"])
        for w in workers:
            hits.add_metric([w.worker_id, "local"], w.counters.local_hits)
            hits.add_metric([w.worker_id, "store"], w.counters.store_hits)
        yield hits
        for name, doc, hist in (
                ("time_per_image_seconds", "Vision-tower time per encoded image, per request.",
                 self.stage.encode_time),
                ("images_per_request", "Images per request sent to the encode stage.",
                 self.stage.images_per_request)):
            family = HistogramMetricFamily(PREFIX + name, doc)
            family.add_metric([], hist.cumulative(), sum_value=hist.sum)
            yield family
        routed = CounterMetricFamily(PREFIX + "router_decisions", "Requests routed per encode worker.",
                                     labels=["worker_id", "policy"])
        for worker_id, count in sorted(self.stage.router.num_routed.items()):
            routed.add_metric([worker_id, self.stage.router.name], count)
        yield routed
        lost = CounterMetricFamily(PREFIX + "workers_lost", "Encode workers lost (process exited or failed).")
        lost.add_metric([], self.stage.num_lost)
        yield lost
        restarts = CounterMetricFamily(PREFIX + "worker_restarts", "Encode worker processes restarted.")
        restarts.add_metric([], self.stage.supervisor.num_restarts["encode"])
        yield restarts


def engine_encode_metrics(stats):
    """The colocated engine's vision tower under the same names (worker_id "engine"); only its
    own LRU tier exists there."""
    labels, values = ["worker_id"], ["engine"]
    lookups = stats.embedding_cache_hits + stats.embedding_cache_misses
    for name, doc, value in (
            ("images", "Image embedding lookups.", lookups),
            ("images_encoded", "Images run through the vision tower.", stats.num_images_encoded),
            ("cache_misses", "Images not in any embedding cache tier.", stats.embedding_cache_misses)):
        family = CounterMetricFamily(PREFIX + name, doc, labels=labels)
        family.add_metric(values, value)
        yield family
    hits = CounterMetricFamily(PREFIX + "cache_hits", "Images whose embeddings were cached, by tier.",
                               labels=["worker_id", "tier"])
    hits.add_metric(["engine", "local"], stats.embedding_cache_hits)
    yield hits
