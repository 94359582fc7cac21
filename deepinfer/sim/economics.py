"""Serving economics from token volumes (measured or simulated) and a price sheet. Pure.

    cost/day          = accelerators · $/accelerator-hour · 24
    revenue/day       = (hit · p_hit + (input − hit) · p_miss + output · p_out) / 1e6
                        · (1 − off_peak_discount · off_peak_share)
    cost-profit margin = (revenue − cost) / cost        (DeepSeek's definition, day 6)
    gross margin       = (revenue − cost) / revenue
    revenue per accelerator-hour = revenue/day / (accelerators · 24)
    payback days       = capex / (revenue/day − cost/day)   (capex: purchase of the fleet;
                         cost/day then covers power, hosting and operations only)

DeepSeek's day-6 figures (2025-03-01) are the reference: 608B input tokens of which 342B
cache hits, 168B output tokens, 226.75 H800 nodes (8 GPUs) at $2/GPU-hour, $0.14 / $0.55 /
$2.19 per million → cost $87,072/day, revenue $562,027/day, margin 545%.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

SECONDS_PER_DAY = 86400.0


@dataclass(frozen=True)
class PriceSheet:
    """Dollars per million tokens; `off_peak_discount` applies to `off_peak_share` of tokens."""

    input_cache_hit_per_m: float = 0.14
    input_cache_miss_per_m: float = 0.55
    output_per_m: float = 2.19
    off_peak_discount: float = 0.0
    off_peak_share: float = 0.0

    def __post_init__(self) -> None:
        for name in ("input_cache_hit_per_m", "input_cache_miss_per_m", "output_per_m"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if not (0 <= self.off_peak_discount <= 1 and 0 <= self.off_peak_share <= 1):
            raise ValueError("off_peak_discount and off_peak_share must be in [0, 1]")


@dataclass(frozen=True)
class Fleet:
    num_accelerators: float  # average over the day (may be fractional: 226.75 nodes · 8)
    accelerator_hour_cost: float = 2.0
    capex_per_accelerator: float | None = None

    def __post_init__(self) -> None:
        if not self.num_accelerators > 0:
            raise ValueError("num_accelerators must be positive")
        if self.accelerator_hour_cost < 0:
            raise ValueError("accelerator_hour_cost must be >= 0")
        if self.capex_per_accelerator is not None and self.capex_per_accelerator < 0:
            raise ValueError("capex_per_accelerator must be >= 0")


@dataclass(frozen=True)
class TokenVolume:
    """Tokens per day."""

    input_tokens: float
    cache_hit_tokens: float
    output_tokens: float

    def __post_init__(self) -> None:
        if min(self.input_tokens, self.cache_hit_tokens, self.output_tokens) < 0:
            raise ValueError("token counts must be >= 0")
        if self.cache_hit_tokens > self.input_tokens:
            raise ValueError("cache hits cannot exceed input tokens")

    @classmethod
    def from_throughput(cls, input_tok_s: float, output_tok_s: float, cache_hit_rate: float,
                        utilization: float = 1.0) -> "TokenVolume":
        """A day at measured/simulated rates, scaled by the share of the day at that load."""
        if not 0 <= cache_hit_rate <= 1 or not 0 < utilization <= 1:
            raise ValueError("cache_hit_rate must be in [0, 1] and utilization in (0, 1]")
        day = SECONDS_PER_DAY * utilization
        return cls(input_tok_s * day, input_tok_s * day * cache_hit_rate, output_tok_s * day)


@dataclass(frozen=True)
class EconomicsReport:
    tokens_per_day: float
    input_tokens_per_day: float
    cache_hit_tokens_per_day: float
    output_tokens_per_day: float
    cache_hit_rate: float
    cost_per_day: float
    revenue_per_day: float
    profit_per_day: float
    cost_profit_margin: float  # (revenue - cost) / cost
    gross_margin: float  # (revenue - cost) / revenue
    revenue_per_accelerator_hour: float
    cost_per_million_tokens: float  # all tokens
    cost_per_million_output_tokens: float
    payback_days: float | None

    def to_dict(self) -> dict:
        return asdict(self)


def economics(volume: TokenVolume, prices: PriceSheet, fleet: Fleet) -> EconomicsReport:
    miss = volume.input_tokens - volume.cache_hit_tokens
    list_revenue = (volume.cache_hit_tokens * prices.input_cache_hit_per_m
                    + miss * prices.input_cache_miss_per_m
                    + volume.output_tokens * prices.output_per_m) / 1e6
    revenue = list_revenue * (1.0 - prices.off_peak_discount * prices.off_peak_share)
    cost = fleet.num_accelerators * fleet.accelerator_hour_cost * 24.0
    profit = revenue - cost
    total = volume.input_tokens + volume.output_tokens
    payback = None
    if fleet.capex_per_accelerator is not None:
        capex = fleet.capex_per_accelerator * fleet.num_accelerators
        payback = capex / profit if profit > 0 else float("inf")
    return EconomicsReport(
        tokens_per_day=total, input_tokens_per_day=volume.input_tokens,
        cache_hit_tokens_per_day=volume.cache_hit_tokens,
        output_tokens_per_day=volume.output_tokens,
        cache_hit_rate=volume.cache_hit_tokens / volume.input_tokens if volume.input_tokens else 0.0,
        cost_per_day=cost, revenue_per_day=revenue, profit_per_day=profit,
        cost_profit_margin=profit / cost if cost else float("inf"),
        gross_margin=profit / revenue if revenue else float("-inf"),
        revenue_per_accelerator_hour=revenue / (fleet.num_accelerators * 24.0),
        cost_per_million_tokens=cost / total * 1e6 if total else float("inf"),
        cost_per_million_output_tokens=(cost / volume.output_tokens * 1e6
                                        if volume.output_tokens else float("inf")),
        payback_days=payback)


def implied_cache_hit_tokens(revenue_per_day: float, volume: TokenVolume,
                             prices: PriceSheet) -> float:
    """The cache-hit count that makes `volume` earn exactly `revenue_per_day` (list prices):
    how far a published revenue pins down a rounded published hit count."""
    spread = prices.input_cache_miss_per_m - prices.input_cache_hit_per_m
    if spread <= 0:
        raise ValueError("hit and miss prices must differ")
    full_miss = (volume.input_tokens * prices.input_cache_miss_per_m
                 + volume.output_tokens * prices.output_per_m) / 1e6
    return (full_miss - revenue_per_day) / spread * 1e6


def format_report(report: EconomicsReport) -> str:
    def money(x: float) -> str:
        return f"${x:,.0f}" if abs(x) >= 100 else f"${x:,.2f}"

    rows = [
        ("tokens/day", f"{report.tokens_per_day / 1e9:,.2f} B"),
        ("  input (of which cache hits)", f"{report.input_tokens_per_day / 1e9:,.2f} B "
                                          f"({100 * report.cache_hit_rate:.1f}%)"),
        ("  output", f"{report.output_tokens_per_day / 1e9:,.2f} B"),
        ("cost/day", money(report.cost_per_day)),
        ("revenue/day", money(report.revenue_per_day)),
        ("profit/day", money(report.profit_per_day)),
        ("cost-profit margin", f"{100 * report.cost_profit_margin:.1f}%"),
        ("gross margin", f"{100 * report.gross_margin:.1f}%"),
        ("revenue per accelerator-hour", money(report.revenue_per_accelerator_hour)),
        ("cost per million tokens", money(report.cost_per_million_tokens)),
        ("cost per million output tokens", money(report.cost_per_million_output_tokens)),
        ("payback", "n/a (no capex)" if report.payback_days is None
         else f"{report.payback_days:,.1f} days"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v:>22}" for k, v in rows)
