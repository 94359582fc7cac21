"""Which of the seed's headline economics figures hold together, against a simulated day. Pure.

The seed states: 155T tokens a day, $38 of revenue per accelerator-hour (off-peak), a margin
above 80%, an 81-day payback (and, with them, a 96% input-cache hit rate). Each pair of them
ties through one quantity, and the simulated DeepSeek day (`sim.diurnal`,
`benchmarks/sim_deepseek_day.py`) gives the one the arithmetic cannot: tokens per accelerator
per second that the hardware delivers at full and at the day's utilisation.

    revenue per accelerator-hour = tokens/s per accelerator · 3600 · blended $ per token
    blended $ per token           = mix of hit / miss input and output at the price sheet
    utilisation needed            = the tokens/s $38/h asks for / the simulated capacity
    fleet                         = 155T / (tokens/s per accelerator · 86,400)
    margin                        = 1 - cost per hour / revenue per hour  (gross)
    payback                       = capex / (revenue - cost) per day  -> the capex it implies
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from deepinfer.sim.economics import PriceSheet

SEED = {"tokens_per_day": 155e12, "revenue_per_accelerator_hour": 38.0, "min_margin": 0.80,
        "payback_days": 81.0, "cache_hit_rate": 0.96}
DAY6_MIX = 608.0 / (608.0 + 168.0)  # input share of all tokens (day 6)


def blended_price_per_token(prices: PriceSheet, hit_rate: float,
                            input_share: float = DAY6_MIX) -> float:
    """$ per token of traffic with `input_share` input at `hit_rate` cache hits."""
    per_m = (input_share * (hit_rate * prices.input_cache_hit_per_m
                            + (1 - hit_rate) * prices.input_cache_miss_per_m)
             + (1 - input_share) * prices.output_per_m)
    return per_m / 1e6


@dataclass(frozen=True)
class SeedCheck:
    claim: str
    implies: str
    consistent: bool | None  # None: depends on a figure the seed does not give
    detail: str

    def to_dict(self) -> dict:
        return asdict(self)


def seed_checks(capacity_tok_s_per_acc: float, day_tok_s_per_acc: float,
                prices: PriceSheet = PriceSheet(), accelerator_hour_cost: float = 2.0,
                off_peak_discount: float = 0.5, seed: dict = SEED,
                other_capacities: dict[str, float] | None = None) -> list[SeedCheck]:
    """The seed's figures against each other and against the simulated throughput per
    accelerator: `capacity_tok_s_per_acc` at full utilisation, `day_tok_s_per_acc` on
    average over the simulated day (both at day 6's input : output mix); `other_capacities`:
    other accelerators' full-utilisation throughput at the same mix (by name)."""
    rev_h = seed["revenue_per_accelerator_hour"]
    price = blended_price_per_token(prices, seed["cache_hit_rate"])
    needed = rev_h / price / 3600.0  # tok/s per accelerator for $38/h at list price
    needed_off_peak = needed / (1.0 - off_peak_discount)  # if $38 is earned at the discount
    fleet = seed["tokens_per_day"] / (needed * 86400.0)
    margin = 1.0 - accelerator_hour_cost / rev_h
    capex = seed["payback_days"] * (rev_h - accelerator_hour_cost) * 24.0
    others = "".join(f"; {name}: {needed / cap:.0%} of its {cap:,.0f}"
                     for name, cap in (other_capacities or {}).items())
    return [
        SeedCheck("$38 per accelerator-hour",
                  f"{needed:,.0f} tok/s per accelerator at list price ({needed_off_peak:,.0f} if "
                  f"earned off-peak at {100 * off_peak_discount:.0f}% off), "
                  f"{seed['cache_hit_rate']:.0%} hits",
                  bool(needed <= capacity_tok_s_per_acc),
                  f"utilisation needed {needed / capacity_tok_s_per_acc:.0%} of the simulated "
                  f"capacity ({capacity_tok_s_per_acc:,.0f} tok/s per accelerator){others}; the "
                  f"simulated day delivers {day_tok_s_per_acc:,.0f} on average"),
        SeedCheck("155T tokens per day",
                  f"{fleet:,.0f} accelerators at that rate (revenue ${rev_h * fleet * 24 / 1e6:,.1f}M"
                  f" per day)", None,
                  f"{seed['tokens_per_day'] / (capacity_tok_s_per_acc * 86400):,.0f} accelerators "
                  f"at the simulated capacity, {seed['tokens_per_day'] / (day_tok_s_per_acc * 86400):,.0f}"
                  " at the simulated day's average"),
        SeedCheck("> 80% margin", f"gross margin {margin:.1%} at ${accelerator_hour_cost:g}/h cost",
                  bool(margin > seed["min_margin"]),
                  f"holds while revenue per accelerator-hour exceeds "
                  f"${accelerator_hour_cost / (1 - seed['min_margin']):.0f}"),
        SeedCheck("81-day payback", f"capex ${capex:,.0f} per accelerator", None,
                  "consistent with $38/h only for that capex and with the $2/h cost covering "
                  "operations alone (a lease rate already includes the purchase)"),
    ]
