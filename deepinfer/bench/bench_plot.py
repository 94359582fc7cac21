"""Plots of a serving run: latency CDFs and output throughput over time (matplotlib, Agg)."""
from __future__ import annotations

import numpy as np

from deepinfer.bench.latency_stats import RequestResult, throughput_timeline


def _cdf(ax, values_ms: list[float], title: str) -> None:
    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of requests")
    ax.grid(alpha=0.3)
    if not values_ms:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        return
    xs = np.sort(np.asarray(values_ms))
    ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs))
    for p in (50, 90, 99):
        ax.axvline(np.percentile(xs, p), ls=":", lw=0.8, color="gray")


def plot_run(results: list[RequestResult], path: str, title: str) -> None:
    """Write a 2x2 figure: CDFs of TTFT, TPOT, E2E latency, and output chunks/s over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in results if r.success]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    _cdf(axes[0, 0], [r.ttft_s * 1e3 for r in done if r.ttft_s is not None], "TTFT CDF")
    _cdf(axes[0, 1], [r.tpot_s * 1e3 for r in done if r.tpot_s is not None], "TPOT CDF")
    _cdf(axes[1, 0], [r.e2e_s * 1e3 for r in done if r.e2e_s is not None], "E2E latency CDF")
    ax = axes[1, 1]
    duration = max((t for r in done for t in r.token_times_s), default=0.0)
    times, rates = throughput_timeline(done, bin_s=max(0.25, duration / 60))
    ax.set_title("output throughput over time")
    ax.set_xlabel("s since start")
    ax.set_ylabel("output chunks / s")
    ax.grid(alpha=0.3)
    if times:
        ax.step(times, rates, where="post")
        starts = sorted(r.start_s for r in results)
        twin = ax.twinx()
        twin.plot(starts, np.arange(1, len(starts) + 1), color="tab:orange", lw=0.8)
        twin.set_ylabel("requests sent", color="tab:orange")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
