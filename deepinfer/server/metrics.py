"""Prometheus metrics of the API server, named like vLLM's with a `deepinfer:` prefix.

Request latencies are observed in the front as deltas arrive (what a client sees, including
IPC); queue time comes from the engine's timestamps. Engine gauges and cumulative counters
(KV usage, prefix-cache queries/hits) are read from the latest engine stats at scrape time by
a custom collector, so they are never stale by more than one step.
"""
from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from deepinfer.wire.engine_messages import EngineStatsSnapshot, RequestTimes
from deepinfer.server.wire_metrics import WireDropsCollector
from deepinfer.wire.metric_prefix import PREFIX

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                  7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class EngineStatsCollector:
    """Exposes the engine's latest `EngineStatsSnapshot` as gauges and counters."""

    def __init__(self, get_stats: Callable[[], EngineStatsSnapshot], model_name: str) -> None:
        self.get_stats = get_stats
        self.model_name = model_name

    def collect(self):
        s = self.get_stats()
        labels = ["model_name"], [self.model_name]
        for name, doc, value in (
                ("num_requests_running", "Requests in the running batch.", s.num_running),
                ("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting),
                ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).",
                 s.kv_cache_usage)):
            gauge = GaugeMetricFamily(PREFIX + name, doc, labels=labels[0])
            gauge.add_metric(labels[1], value)
            yield gauge
        for name, doc, value in (
                ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                 s.prefix_cache_queries),
                ("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                 s.prefix_cache_hits),
                ("num_preemptions", "Requests preempted by the scheduler.", s.num_preemptions),
                # mean |predicted - measured| / measured step time = rate(sum) / rate(count)
                ("step_time_prediction_abs_error_ratio_sum",
                 "Cost-model error summed over predicted steps (|pred - meas| / meas).",
                 s.prediction_abs_error_sum),
                ("step_time_prediction_steps", "Steps with a cost-model prediction.",
                 s.num_predicted_steps),
                ("engine_step_failures", "Engine steps that raised and were recovered from "
                 "(the requests they were pinned on failed; the rest went on).",
                 s.num_failed_steps),
                # speculative decoding (vLLM's names); mean acceptance length =
                # 1 + rate(accepted_tokens) / rate(drafts)
                ("spec_decode_num_drafts", "Verifications of draft tokens.",
                 s.spec_decode_num_drafts),
                ("spec_decode_num_draft_tokens", "Draft tokens verified.",
                 s.spec_decode_num_draft_tokens),
                ("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                 s.spec_decode_num_accepted_tokens)):
            counter = CounterMetricFamily(PREFIX + name, doc, labels=labels[0])
            counter.add_metric(labels[1], value)
            yield counter
        per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by position in the draft.",
                                      labels=["model_name", "position"])
        for position, value in enumerate(s.spec_decode_num_accepted_tokens_per_pos):
            per_pos.add_metric([self.model_name, str(position)], value)
        yield per_pos
        if s.embedding_cache_hits is not None:  # colocated vision tower: deepinfer:encode_*
            from deepinfer.multimodal.encode_metrics import engine_encode_metrics
            yield from engine_encode_metrics(s)


class ServerMetrics:
    """One registry per server (no module-level state)."""

    def __init__(self, model_name: str, get_stats: Callable[[], EngineStatsSnapshot]) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(EngineStatsCollector(get_stats, model_name))
        self.registry.register(WireDropsCollector(lambda: get_stats().wire_frames_dropped))

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(PREFIX + name, doc, ["model_name"], buckets=buckets,
                             registry=self.registry).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.",
                              _TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between output tokens.",
                             _TOKEN_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.",
                              _TOKEN_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency.",
                             _REQUEST_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Time from arrival to first schedule.", _REQUEST_BUCKETS)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prefilled prompt tokens.",
                                     ["model_name"], registry=self.registry).labels(model_name)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens.",
                                         ["model_name"], registry=self.registry
                                         ).labels(model_name)
        self.request_success = Counter(PREFIX + "request_success", "Finished requests by reason.",
                                ["model_name", "finished_reason"], registry=self.registry)
        # reason: "request" (a step failed on this request; the others went on), "engine"
        # (a step failed on no single request: all in flight failed), "engine_dead"
        self.request_failures = Counter(PREFIX + "request_failures",
                                        "Requests answered with an engine error, by reason.",
                                        ["model_name", "reason"], registry=self.registry)

    def request_timer(self, arrival_time: float) -> RequestTimer:
        return RequestTimer(self, arrival_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Observes one request's latencies as its deltas arrive (times in time.monotonic())."""

    def __init__(self, metrics: ServerMetrics, arrival_time: float) -> None:
        self.metrics = metrics
        self.arrival_time = arrival_time
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.num_tokens = 0  # of choice 0, which stands for the request's latency

    def on_tokens(self, now: float, num_new_tokens: int, num_prompt_tokens: int) -> None:
        self.metrics.generation_tokens.inc(num_new_tokens)
        if num_new_tokens <= 0:
            return
        if self.first_token_time is None:
            self.first_token_time = now
            self.metrics.ttft.observe(now - self.arrival_time)
            self.metrics.prompt_tokens.inc(num_prompt_tokens)
        elif self.last_token_time is not None:
            self.metrics.itl.observe(now - self.last_token_time)
        self.last_token_time = now
        self.num_tokens += num_new_tokens

    def on_failure(self, reason: str) -> None:
        self.metrics.request_failures.labels(self.metrics.model_name, reason).inc()

    def on_finish(self, now: float, finish_reason: str | None,
                  times: RequestTimes | None) -> None:
        self.metrics.e2e.observe(now - self.arrival_time)
        if self.first_token_time is not None and self.num_tokens > 1:
            self.metrics.tpot.observe(
                (now - self.first_token_time) / (self.num_tokens - 1))
        if times is not None and times.first_scheduled_time is not None:
            self.metrics.queue_time.observe(
                max(0.0, times.first_scheduled_time - times.arrival_time))
        self.metrics.request_success.labels(self.metrics.model_name, finish_reason or "abort").inc()
