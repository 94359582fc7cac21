"""Serving-benchmark statistics and the /metrics prefix-cache scrape."""
from __future__ import annotations

import math

import numpy as np
import pytest

from deepinfer.bench.latency_stats import (
    LatencyStats, RequestResult, format_summary, summarize, throughput_timeline,
)
from deepinfer.bench.serve_client import BenchRun, PrefixCacheCounters, parse_prefix_cache_counters


def result(ttft, e2e, out, itl=(), prompt=10, start=0.0, cached=None):
    return RequestResult(success=True, prompt_len=prompt, output_len=out, start_s=start,
                         ttft_s=ttft, e2e_s=e2e, itl_s=list(itl), cached_tokens=cached,
                         token_times_s=[start + ttft + sum(itl[:i]) for i in range(out)])


def test_tpot_excludes_the_first_token():
    r = result(ttft=0.5, e2e=2.5, out=5)
    assert r.tpot_s == pytest.approx(0.5)
    assert result(ttft=0.5, e2e=0.5, out=1).tpot_s is None
    assert RequestResult(success=False, prompt_len=3).tpot_s is None


def test_summary_counts_throughput_and_percentiles():
    results = [result(0.1 * i, 1.0 + 0.1 * i, 4, itl=[0.2, 0.3, 0.4], prompt=100)
               for i in range(1, 11)]
    results.append(RequestResult(success=False, prompt_len=100, error="HTTP 429"))
    s = summarize(results, duration_s=5.0)
    assert (s.num_requests, s.num_completed, s.num_failed) == (11, 10, 1)
    assert s.total_input_tokens == 1000 and s.total_output_tokens == 40
    assert s.request_throughput == pytest.approx(2.0)
    assert s.output_throughput == pytest.approx(8.0)
    assert s.total_token_throughput == pytest.approx(208.0)
    ttfts = np.arange(1, 11) * 100.0
    assert s.ttft_ms.mean == pytest.approx(ttfts.mean())
    assert s.ttft_ms.p90 == pytest.approx(np.percentile(ttfts, 90))
    assert s.itl_ms.count == 30 and s.itl_ms.p50 == pytest.approx(300.0)
    assert s.tpot_ms.mean == pytest.approx(1000.0 / 3)  # (e2e - ttft) / (4 - 1) = 1.0 / 3
    assert s.goodput is None and s.cached_token_fraction is None
    text = format_summary(s)
    assert "Successful requests:" in text and "P99 TTFT (ms):" in text


def test_goodput_needs_every_slo():
    results = [result(0.1, 1.1, 11), result(0.1, 3.1, 11), result(0.9, 1.9, 11)]
    # TPOTs: 0.1, 0.3, 0.1 s
    s = summarize(results, duration_s=2.0, slo_ttft_ms=500, slo_tpot_ms=200)
    assert s.goodput == pytest.approx(0.5) and s.slo_attainment == pytest.approx(1 / 3)
    s = summarize(results, duration_s=2.0, slo_ttft_ms=500)
    assert s.goodput == pytest.approx(1.0)


def test_cached_fraction_from_usage():
    s = summarize([result(0.1, 1, 2, prompt=100, cached=50), result(0.1, 1, 2, prompt=100,
                                                                      cached=0)], 1.0)
    assert s.cached_token_fraction == pytest.approx(0.25)


def test_empty_stats_are_nan():
    stats = LatencyStats.of([])
    assert stats.count == 0 and math.isnan(stats.p99)


def test_throughput_timeline_bins_chunk_times():
    r1 = RequestResult(True, 1, 3, token_times_s=[0.1, 0.2, 1.5])
    r2 = RequestResult(True, 1, 2, token_times_s=[0.3, 2.9])
    times, rates = throughput_timeline([r1, r2], bin_s=1.0)
    assert times == [0.0, 1.0, 2.0] and rates == [3.0, 1.0, 1.0]
    assert throughput_timeline([], 1.0) == ([], [])


METRICS = """# HELP deepinfer:prefix_cache_queries Prompt tokens looked up.
# TYPE deepinfer:prefix_cache_queries counter
deepinfer:prefix_cache_queries_total{model_name="m"} 1200.0
deepinfer:prefix_cache_hits_total{model_name="m"} 300.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 800.0
deepinfer:prompt_tokens_total{model_name="m"} 5.0
"""


def test_prefix_cache_counters_sum_over_label_sets_and_prefixes():
    c = parse_prefix_cache_counters(METRICS)
    assert (c.queries, c.hits) == (2000.0, 300.0)
    assert parse_prefix_cache_counters("x_total 3\n") is None
    run = BenchRun("m", [], 1.0, PrefixCacheCounters(1000, 100), PrefixCacheCounters(3000, 900))
    assert run.prefix_cache_hit_rate == pytest.approx(0.4)
    assert BenchRun("m", [], 1.0, None, c).prefix_cache_hit_rate is None
