"""`deepinfer economics`: tokens/day, revenue, margin and payback from a price sheet and
either token volumes per day or a measured/simulated run's JSON (`bench serve`/`simulate`).

    deepinfer economics --preset deepseek-day6
    deepinfer economics --input-tokens 608B --cache-hit-tokens 342B --output-tokens 168B \
        --nodes 226.75 --accelerator-hour-cost 2
    deepinfer economics --from-run sim.json --accelerators 64 --utilization 0.6 --json e.json
    deepinfer economics --from-day benchmarks/results/sim_deepseek_day.json --seed-figures
"""
from __future__ import annotations

import argparse
import json

PRESETS = {
    # DeepSeek-V3/R1 inference system overview, day 6 (2025-03-01), 24 h of its service.
    "deepseek-day6": {"input_tokens": "608B", "cache_hit_tokens": "342B", "output_tokens": "168B",
                      "nodes": 226.75, "gpus_per_node": 8, "accelerator_hour_cost": 2.0},
}
_SUFFIX = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}


def parse_count(text: str) -> float:
    """'608B' -> 6.08e11; plain numbers accepted. ValueError otherwise."""
    text = str(text).strip().upper()
    scale = _SUFFIX.get(text[-1:], None)
    try:
        value = float(text[:-1]) * scale if scale else float(text)
    except ValueError:
        raise ValueError(f"not a token count: {text!r} (e.g. 608B, 1.5T, 2e9)") from None
    if value < 0:
        raise ValueError(f"token counts must be >= 0, got {text!r}")
    return value


def register(sub) -> None:
    p = sub.add_parser("economics", help="tokens/day, revenue, margin, payback from a price sheet")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None)
    v = p.add_argument_group("volume (per day), or a run's JSON")
    v.add_argument("--input-tokens", default=None, help="e.g. 608B")
    v.add_argument("--cache-hit-tokens", default=None, help="input tokens served from cache")
    v.add_argument("--output-tokens", default=None)
    v.add_argument("--from-run", default=None, metavar="JSON",
                   help="bench serve / simulate JSON: its throughput and hit rate, all day")
    v.add_argument("--utilization", type=float, default=1.0,
                   help="with --from-run: share of the day at the run's load")
    v.add_argument("--from-day", default=None, metavar="JSON",
                   help="a simulated day (benchmarks/sim_deepseek_day.py): its delivered "
                        "tokens, hit rate and mean fleet")
    p.add_argument("--seed-figures", action="store_true",
                   help="with --from-day: which of the seed's figures (155T tokens/day, $38 "
                        "per accelerator-hour, the margin above 80 percent, an 81-day "
                        "payback) hold together")
    f = p.add_argument_group("fleet")
    f.add_argument("--accelerators", type=float, default=None)
    f.add_argument("--nodes", type=float, default=None, help="with --gpus-per-node")
    f.add_argument("--gpus-per-node", type=int, default=None, help="default 8")
    f.add_argument("--accelerator-hour-cost", type=float, default=None,
                   help="$ per GPU-hour (default 2)")
    f.add_argument("--capex-per-accelerator", type=float, default=None,
                   help="$ purchase price per GPU (payback days)")
    s = p.add_argument_group("prices ($ per million tokens)")
    s.add_argument("--price-cache-hit", type=float, default=0.14)
    s.add_argument("--price-cache-miss", type=float, default=0.55)
    s.add_argument("--price-output", type=float, default=2.19)
    s.add_argument("--off-peak-discount", type=float, default=0.0, help="e.g. 0.5 = half price")
    s.add_argument("--off-peak-share", type=float, default=0.0,
                   help="share of the tokens served at the off-peak price")
    p.add_argument("--json", dest="json_path", default=None)
    p.set_defaults(func=run)


def _read_day(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
        day = data["day"]
        float(day["input_tokens_per_day"]), float(day["output_tokens_per_day"])
        float(day["nodes_mean"])
        return data
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"cannot read simulated day {path}: {e}") from None


def _volume(args, sim_accelerators: list):
    from deepinfer.sim.economics import TokenVolume
    if args.from_day:
        day = _read_day(args.from_day)["day"]
        sim_accelerators.append(day["nodes_mean"] * (args.gpus_per_node or 8))
        hits = day["input_tokens_per_day"] * float(day.get("hit_rate") or 0.0)
        return TokenVolume(day["input_tokens_per_day"], hits, day["output_tokens_per_day"])
    if args.from_run:
        try:
            with open(args.from_run) as f:
                data = json.load(f)
            summary = data["summary"]
            duration = float(summary["duration_s"])
            hit = data.get("prefix_cache_hit_rate") or summary.get("cached_token_fraction") or 0.0
            sim_accelerators.append((data.get("simulation") or {}).get("num_accelerators"))
        except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"cannot read run {args.from_run}: {e}") from None
        return TokenVolume.from_throughput(summary["total_input_tokens"] / duration,
                                           summary["total_output_tokens"] / duration, hit,
                                           args.utilization)
    if None in (args.input_tokens, args.output_tokens):
        raise ValueError("give --input-tokens and --output-tokens (and --cache-hit-tokens), "
                         "--from-run, or --preset")
    return TokenVolume(parse_count(args.input_tokens), parse_count(args.cache_hit_tokens or 0),
                       parse_count(args.output_tokens))


DAY6_PUBLISHED = {"cost_per_day": 87072, "revenue_per_day": 562027, "cost_profit_margin": 5.45}


def _print_day6_reconciliation(volume, prices, fleet) -> None:
    """The published token counts are rounded to 1B; say which hit count gives the published
    revenue exactly, and what that does to the margin."""
    from deepinfer.sim.economics import TokenVolume, economics, implied_cache_hit_tokens
    hits = implied_cache_hit_tokens(DAY6_PUBLISHED["revenue_per_day"], volume, prices)
    exact = economics(TokenVolume(volume.input_tokens, hits, volume.output_tokens), prices, fleet)
    print(f"published: cost $87,072, revenue $562,027, margin 545%. The token counts are "
          f"rounded to 1B: {hits / 1e9:.3f}B cache hits ({100 * hits / volume.input_tokens:.2f}%,"
          f" published as 56.3%) give revenue ${exact.revenue_per_day:,.0f} and margin "
          f"{100 * exact.cost_profit_margin:.1f}%")


def _print_seed_figures(args, report, prices, fleet) -> None:
    """The seed's figures checked against each other and the simulated day's throughput."""
    from deepinfer.sim.seed_economics import SEED, seed_checks
    data = _read_day(args.from_day)
    capacity = (data.get("capacity") or {}).get("per_accelerator") or {}
    full = capacity.get(f"{SEED['cache_hit_rate']:.3f}")
    if full is None:
        raise ValueError(f"{args.from_day} has no capacity at {SEED['cache_hit_rate']:.0%} hits")
    day_rate = report.tokens_per_day / (fleet.num_accelerators * 86400.0)
    print(f"\nseed figures vs this simulated day ({day_rate:,.0f} tok/s per accelerator on "
          f"average, {full:,.0f} at full utilisation with {SEED['cache_hit_rate']:.0%} hits):")
    gb200 = ((data.get("capacity") or {}).get("gb200") or {}).get("per_accelerator") or {}
    others = ({"GB200 (vLLM settings)": gb200[f"{SEED['cache_hit_rate']:.3f}"]}
              if f"{SEED['cache_hit_rate']:.3f}" in gb200 else None)
    for check in seed_checks(full, day_rate, prices, fleet.accelerator_hour_cost,
                             prices.off_peak_discount or 0.5, other_capacities=others):
        verdict = {True: "consistent", False: "NOT consistent", None: "depends"}[check.consistent]
        print(f"  {check.claim:26s} {verdict:15s} {check.implies}; {check.detail}")


def run(args: argparse.Namespace) -> int:
    from deepinfer.cli.main import CLIError
    from deepinfer.sim.economics import Fleet, PriceSheet, economics, format_report

    preset = PRESETS.get(args.preset, {})
    for key, default in (*preset.items(), ("gpus_per_node", 8), ("accelerator_hour_cost", 2.0)):
        if getattr(args, key) is None:  # flags given on the command line win over the preset
            setattr(args, key, default)
    try:
        found = []
        volume = _volume(args, found)
        accelerators = args.accelerators
        if accelerators is None and args.nodes is not None:
            accelerators = args.nodes * args.gpus_per_node
        if accelerators is None and found and found[0]:
            accelerators = found[0]
        if accelerators is None:
            raise ValueError("give --accelerators or --nodes (the fleet size)")
        prices = PriceSheet(args.price_cache_hit, args.price_cache_miss, args.price_output,
                            args.off_peak_discount, args.off_peak_share)
        fleet = Fleet(accelerators, args.accelerator_hour_cost, args.capex_per_accelerator)
        report = economics(volume, prices, fleet)
    except ValueError as e:
        raise CLIError(str(e)) from None
    print(format_report(report))
    if args.seed_figures:
        if not args.from_day:
            raise CLIError("--seed-figures needs --from-day (the simulated throughput)")
        try:
            _print_seed_figures(args, report, prices, fleet)
        except ValueError as e:
            raise CLIError(str(e)) from None
    if args.preset == "deepseek-day6":
        _print_day6_reconciliation(volume, prices, fleet)
    if args.json_path:
        from dataclasses import asdict
        payload = {"report": report.to_dict(), "prices": asdict(prices), "fleet": asdict(fleet),
                   "volume": asdict(volume)}
        with open(args.json_path, "w") as f:
            json.dump(payload, f, indent=1, default=str)
        print(f"wrote {args.json_path}")
    return 0
