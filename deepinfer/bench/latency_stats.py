"""Serving benchmark statistics from per-request results. Pure: stdlib + numpy.

Definitions (as vLLM's benchmark_serving):
  success  the server generated output tokens (usage.completion_tokens; the text may be empty)
  TTFT  arrival at the client → first output chunk with text (or the final chunk, if none has)
  TPOT  (e2e − ttft) / (output_tokens − 1), one value per request with > 1 output token
  ITL   gaps between consecutive output chunks, pooled over all requests
  E2E   send → last chunk
  goodput  completed requests per second that meet every given SLO (TTFT and/or TPOT)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    """What the client saw for one request (times in seconds; `start_s` from run start)."""

    success: bool
    prompt_len: int
    output_len: int = 0
    start_s: float = 0.0
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    token_times_s: list[float] = field(default_factory=list)  # chunk arrivals, from run start
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, if reported
    error: str | None = None
    usage_reported: bool = False  # output_len is usage.completion_tokens, not a chunk count

    @property
    def tpot_s(self) -> float | None:
        if not self.success or self.output_len < 2 or self.ttft_s is None or self.e2e_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_len - 1)


@dataclass(frozen=True)
class LatencyStats:
    """Milliseconds."""

    mean: float
    p50: float
    p90: float
    p99: float
    max: float
    count: int

    @classmethod
    def of(cls, values_s: list[float]) -> LatencyStats:
        if not values_s:
            nan = float("nan")
            return cls(nan, nan, nan, nan, nan, 0)
        ms = np.asarray(values_s, dtype=float) * 1e3
        p50, p90, p99 = np.percentile(ms, PERCENTILES)
        return cls(float(ms.mean()), float(p50), float(p90), float(p99), float(ms.max()),
                   len(ms))


@dataclass(frozen=True)
class BenchSummary:
    num_requests: int
    num_completed: int
    num_failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (input + output) tokens / s
    ttft_ms: LatencyStats
    tpot_ms: LatencyStats
    itl_ms: LatencyStats
    e2e_ms: LatencyStats
    goodput: float | None  # requests / s meeting the SLOs (None: no SLO given)
    slo_attainment: float | None  # fraction of all requests meeting the SLOs
    cached_token_fraction: float | None  # from per-request usage, when the server reports it


def meets_slo(result: RequestResult, slo_ttft_ms: float | None,
              slo_tpot_ms: float | None) -> bool:
    if not result.success or result.ttft_s is None:
        return False
    if slo_ttft_ms is not None and result.ttft_s * 1e3 > slo_ttft_ms:
        return False
    tpot = result.tpot_s
    return slo_tpot_ms is None or tpot is None or tpot * 1e3 <= slo_tpot_ms


def summarize(results: list[RequestResult], duration_s: float,
              slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None
              ) -> BenchSummary:
    """Aggregate one run. `duration_s` is wall time from the first send to the last answer."""
    done = [r for r in results if r.success]
    duration_s = max(duration_s, 1e-9)
    input_tokens = sum(r.prompt_len for r in done)
    output_tokens = sum(r.output_len for r in done)
    goodput = attainment = None
    if slo_ttft_ms is not None or slo_tpot_ms is not None:
        good = sum(meets_slo(r, slo_ttft_ms, slo_tpot_ms) for r in results)
        goodput = good / duration_s
        attainment = good / len(results) if results else 0.0
    reported = [r for r in done if r.cached_tokens is not None]
    cached = (sum(r.cached_tokens for r in reported) / max(1, sum(r.prompt_len for r in reported))
              if reported else None)
    return BenchSummary(
        num_requests=len(results), num_completed=len(done),
        num_failed=len(results) - len(done), duration_s=duration_s,
        total_input_tokens=input_tokens, total_output_tokens=output_tokens,
        request_throughput=len(done) / duration_s,
        output_throughput=output_tokens / duration_s,
        total_token_throughput=(input_tokens + output_tokens) / duration_s,
        ttft_ms=LatencyStats.of([r.ttft_s for r in done if r.ttft_s is not None]),
        tpot_ms=LatencyStats.of([r.tpot_s for r in done if r.tpot_s is not None]),
        itl_ms=LatencyStats.of([x for r in done for x in r.itl_s]),
        e2e_ms=LatencyStats.of([r.e2e_s for r in done if r.e2e_s is not None]),
        goodput=goodput, slo_attainment=attainment, cached_token_fraction=cached)


def throughput_timeline(results: list[RequestResult], bin_s: float = 1.0
                        ) -> tuple[list[float], list[float]]:
    """(bin start times, output chunks per second in each bin) over the whole run."""
    times = np.asarray([t for r in results for t in r.token_times_s], dtype=float)
    if times.size == 0:
        return [], []
    num_bins = int(times.max() // bin_s) + 1
    counts = np.bincount((times // bin_s).astype(int), minlength=num_bins)
    return (np.arange(num_bins) * bin_s).tolist(), (counts / bin_s).tolist()


def format_summary(summary: BenchSummary, title: str = "Serving Benchmark Result") -> str:
    """A human-readable block in the style of vLLM's benchmark output."""
    lines = [f"{' ' + title + ' ':=^60}"]

    def row(label: str, value) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{label:<42}{text:>18}")

    row("Successful requests:", summary.num_completed)
    row("Failed requests:", summary.num_failed)
    row("Benchmark duration (s):", summary.duration_s)
    row("Total input tokens:", summary.total_input_tokens)
    row("Total generated tokens:", summary.total_output_tokens)
    row("Request throughput (req/s):", summary.request_throughput)
    row("Output token throughput (tok/s):", summary.output_throughput)
    row("Total token throughput (tok/s):", summary.total_token_throughput)
    if summary.goodput is not None:
        row("Request goodput (req/s):", summary.goodput)
        row("SLO attainment (%):", 100.0 * summary.slo_attainment)
    if summary.cached_token_fraction is not None:
        row("Cached prompt tokens (usage, %):", 100.0 * summary.cached_token_fraction)
    for name, short, stats in (("Time to First Token", "TTFT", summary.ttft_ms),
                               ("Time per Output Token (excl. 1st token)", "TPOT",
                                summary.tpot_ms),
                               ("Inter-token Latency", "ITL", summary.itl_ms),
                               ("End-to-end Latency", "E2EL", summary.e2e_ms)):
        lines.append(f"{' ' + name + ' ':-^60}")
        row(f"Mean {short} (ms):", stats.mean)
        for p in PERCENTILES:
            row(f"P{p} {short} (ms):", getattr(stats, f"p{p}"))
    lines.append("=" * 60)
    return "\n".join(lines)


def request_columns(results: list[RequestResult]) -> dict[str, list]:
    """Per-request results as columns: the "requests" section of a bench-serve JSON, shared
    by measured and simulated runs so the two diff field by field."""
    return {"prompt_len": [r.prompt_len for r in results],
            "output_len": [r.output_len for r in results],
            "start_s": [r.start_s for r in results],
            "ttft_s": [r.ttft_s for r in results],
            "tpot_s": [r.tpot_s for r in results],
            "e2e_s": [r.e2e_s for r in results],
            "itl_s": [r.itl_s for r in results],
            "cached_tokens": [r.cached_tokens for r in results],
            "errors": [r.error for r in results]}



def finite_json(value):
    """A JSON-ready copy: JSON has no NaN/inf, so they are written as null (nested too)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite_json(v) for v in value]
    return value
