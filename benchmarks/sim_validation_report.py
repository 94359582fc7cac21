"""benchmarks/sim_validation.py's comparison and report: measured runs vs simulated samples.

The real engine's own run-to-run spread can be as wide as the target (P=2/D=2: five quiet runs,
output throughput 43.8-49.4 tok/s), so a case is judged like with like: the mean of N measured
runs against the mean of K perturbed simulations (`deepinfer.sim.sampling`), each with its
spread ([min, max] of the runs, the samples' band). The single-run errors (the deterministic
simulation against each run) are kept beside it. Also where each TTFT p50 falls relative to
the steps first tokens come out of (`p50_position`): a p50 between two steps moves by half a
step with one request more or less in the earlier one. No engine here: pure functions.
"""
from __future__ import annotations

import math

from deepinfer.bench.latency_stats import BenchSummary, LatencyStats
from deepinfer.sim.sampling import band

TARGET = 0.15  # the validation target: within 15%
METRICS = (("ttft_ms", "p50"), ("tpot_ms", "p50"), ("output_throughput", None),
           ("ttft_ms", "mean"))  # the mean: not on a step boundary as p50 can be
HEADLINE = ("ttft_ms_p50", "tpot_ms_p50", "output_throughput")  # the headline metrics
# First tokens closer than this are one step's: the client sees one step's tokens within a
# few ms of each other, and a step of the validation's engine takes >= ~30 ms.
GROUP_GAP_MS = 20.0


def metric_name(key: str, sub: str | None) -> str:
    return f"{key}_{sub}" if sub else key


def metric(summary: BenchSummary, key: str, sub: str | None) -> float:
    value = getattr(summary, key)
    return getattr(value, sub) if sub else value


def summary_from_dict(data: dict) -> BenchSummary:
    """A `BenchSummary` back from its JSON form (NaN stats were written as null)."""
    def stats(d: dict) -> LatencyStats:
        return LatencyStats(**{k: (float("nan") if v is None else v) for k, v in d.items()})
    return BenchSummary(**{k: stats(v) if isinstance(v, dict) else v for k, v in data.items()})


def compare(measured: BenchSummary, simulated: BenchSummary) -> dict:
    """One measured run against one simulation: measured, simulated, error per metric."""
    rows = {}
    for key, sub in METRICS:
        m, s = metric(measured, key, sub), metric(simulated, key, sub)
        rows[metric_name(key, sub)] = {"measured": m, "simulated": s,
                                       "error": s / m - 1.0 if m else None}
    return rows


def _rel(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b or math.isnan(a) or math.isnan(b):
        return None
    return a / b - 1.0


def repeat_rows(measured: list[BenchSummary], simulated: BenchSummary,
                samples: list[BenchSummary] | None = None) -> dict:
    """Per metric: the measured runs' mean and [min, max], the deterministic simulation, the
    samples' mean and band (None without samples), the error of the simulated mean (the
    samples' mean, else the deterministic run) against the measured mean and whether it is
    within TARGET, and the single-run errors (deterministic simulation vs each run)."""
    rows = {}
    for key, sub in METRICS:
        values = [metric(s, key, sub) for s in measured]
        finite = [v for v in values if not math.isnan(v)]
        m_mean = sum(finite) / len(finite) if finite else None
        det = metric(simulated, key, sub)
        sim_band = band([metric(s, key, sub) for s in samples]) if samples else None
        s_mean = sim_band["mean"] if sim_band else det
        error = _rel(s_mean, m_mean)
        rows[metric_name(key, sub)] = {
            "measured_runs": values, "measured_mean": m_mean,
            "measured_min": min(finite) if finite else None,
            "measured_max": max(finite) if finite else None,
            "simulated": det, "simulated_band": sim_band, "simulated_mean": s_mean,
            "error_of_mean": error,
            "within_target": None if error is None else abs(error) <= TARGET,
            "single_run_errors": [_rel(det, v) for v in values]}
    return rows


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:+.1f}%"


def format_repeat_rows(rows: dict) -> str:
    lines = []
    for name, r in rows.items():
        if r["measured_mean"] is None:
            lines.append(f"  {name:<20} measured n/a")
            continue
        b = r["simulated_band"]
        sim = (f"{r['simulated_mean']:9.2f} [{b['lo']:.2f}, {b['hi']:.2f}] ({b['kind']}, "
               f"det. {r['simulated']:.2f})" if b and b["mean"] is not None
               else f"{r['simulated']:9.2f}")
        verdict = {True: "yes", False: "NO", None: "n/a"}[r["within_target"]]
        head = " *" if name in HEADLINE else "  "
        lines.append(
            f" {head}{name:<20} measured {r['measured_mean']:9.2f} [{r['measured_min']:.2f}, "
            f"{r['measured_max']:.2f}] ({len(r['measured_runs'])} runs)  simulated {sim}  "
            f"error of mean {_pct(r['error_of_mean'])} within {100 * TARGET:.0f}%: {verdict}"
            f"  single runs: " + " ".join(_pct(e) for e in r["single_run_errors"]))
    return "\n".join(lines)


# ---- TTFT p50 and step boundaries -----------------------------------------------------------
def step_groups(times_ms: list[float], gap_ms: float = GROUP_GAP_MS) -> list[tuple[int, int]]:
    """Sorted first-token times split into steps: [start, end) index ranges, a new step
    wherever two consecutive times are more than `gap_ms` apart."""
    v = sorted(times_ms)
    groups, start = [], 0
    for i in range(1, len(v)):
        if v[i] - v[i - 1] > gap_ms:
            groups.append((start, i))
            start = i
    if v:
        groups.append((start, len(v)))
    return groups


def p50_position(times_ms: list[float], gap_ms: float = GROUP_GAP_MS,
                 of: str = "ttft") -> dict | None:
    """Where the p50 of these TTFTs (numpy's: the mean of the two middle values for an even
    count) falls among the clusters they form (requests sent together: the steps their first
    tokens came out of): whether the two middle values are in different steps (on a boundary),
    how many requests would have to change step to move it into another one (0 on a
    boundary), and the p50 with one request more or one fewer out before it (the rank shifted
    by one): its swing from step granularity. For spread-out arrivals the clusters are not
    steps, but the swing still says how sensitive the p50 is to one request. `of` names the
    values (earlier outputs kept only first-token times since the run's start)."""
    v = sorted(times_ms)
    n = len(v)
    if n < 3:
        return None
    groups = step_groups(v, gap_ms)
    lo, hi = (n - 1) // 2, n // 2

    def group_of(rank: int) -> int:
        return next(i for i, (s, e) in enumerate(groups) if s <= rank < e)

    g_lo, g_hi = group_of(lo), group_of(hi)
    start, end = groups[g_lo]
    margin = 0 if g_lo != g_hi else min(lo - start + 1, end - hi)
    p50 = (v[lo] + v[hi]) / 2
    earlier = (v[lo - 1] + v[hi - 1]) / 2  # one more request out before: the rank moves down
    later = (v[lo + 1] + v[hi + 1]) / 2
    return {"of": of, "p50_ms": p50, "num_steps": len(groups),
            "step_sizes": [e - s for s, e in groups],
            "step_first_token_ms": [v[s] for s, _ in groups],
            "on_step_boundary": g_lo != g_hi, "margin_requests": margin,
            "p50_one_request_shifted_ms": [earlier, later],
            "swing": [_rel(earlier, p50), _rel(later, p50)]}


def format_p50_position(label: str, pos: dict | None) -> str:
    """One line; the groups are steps when the requests were sent together (W1)."""
    if pos is None:
        return f"  TTFT p50 {label}: too few requests"
    where = ("on a group boundary" if pos["on_step_boundary"] else
             f"{pos['margin_requests']} request(s) from a group boundary")
    name = "TTFT p50" if pos["of"] == "ttft" else "p50 of the first-token times"
    return (f"  {name} {label}: {pos['p50_ms']:.0f} ms, {where} ({pos['num_steps']} groups "
            f"> {GROUP_GAP_MS:.0f} ms apart); one request more / fewer before it: "
            f"{_pct(pos['swing'][0])} / {_pct(pos['swing'][1])}")


def measured_first_gap(workers: dict[str, dict[str, float]]) -> dict[str, float | None] | None:
    """The decode workers' counters (one run's, summed over them) as mean seconds per admitted
    request: allocation wait, KV fetch wait, KV write + admission, admission -> first token;
    and the mean of the later token gaps. None when no decode worker reported."""
    decode = [c for w, c in workers.items() if w.startswith("decode")]
    admitted = sum(c.get("decode_admitted_requests", 0.0) for c in decode)
    gaps = sum(c.get("decode_token_gaps", 0.0) for c in decode)
    if not admitted:
        return None

    def per(key: str, n: float) -> float | None:
        return sum(c.get(key, 0.0) for c in decode) / n if n else None
    return {"alloc_wait_s": per("decode_alloc_wait_seconds", admitted),
            "fetch_wait_s": per("decode_fetch_wait_seconds", admitted),
            "kv_write_s": per("decode_kv_write_seconds", admitted),
            "first_token_wait_s": per("decode_first_token_wait_seconds", admitted),
            "later_gap_s": per("decode_token_gap_seconds", gaps),
            "num_admitted": admitted, "num_later_gaps": gaps}


def format_first_gap(measured: dict | None, simulated: dict | None) -> str | None:
    """One line: the first decode gap's parts, measured (decode workers) and simulated."""
    if not measured or not simulated or simulated.get("num_first_gaps", 0) == 0:
        return None

    def ms(x: float | None) -> str:
        return "n/a" if x is None else f"{1e3 * x:.1f}"
    m, s = measured, simulated
    return (f"  first decode gap (mean ms): measured alloc {ms(m['alloc_wait_s'])} + fetch "
            f"{ms(m['fetch_wait_s'])} + write {ms(m['kv_write_s'])} + admit->token "
            f"{ms(m['first_token_wait_s'])}, later gaps {ms(m['later_gap_s'])}; simulated "
            f"queue+alloc {ms(s['queue_alloc_s'])} + transfer {ms(s['transfer_s'])} + "
            f"admit->token {ms(s['admit_to_token_s'])} (gap {ms(s['gap_s'])}), later gaps "
            f"{ms(s['later_gap_s'])}")
