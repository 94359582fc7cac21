"""Economics: DeepSeek's day-6 arithmetic, prices, payback, and the CLI's one-line errors."""
from __future__ import annotations

import pytest

from deepinfer.cli.economics import parse_count
from deepinfer.cli.main import main
from deepinfer.sim.economics import (Fleet, PriceSheet, TokenVolume, economics,
                                     implied_cache_hit_tokens)

DAY6_PRICES = PriceSheet(0.14, 0.55, 2.19)
DAY6_FLEET = Fleet(226.75 * 8, accelerator_hour_cost=2.0)
DAY6_VOLUME = TokenVolume(608e9, 342e9, 168e9)


def test_day6_cost_is_exact():
    report = economics(DAY6_VOLUME, DAY6_PRICES, DAY6_FLEET)
    assert report.cost_per_day == pytest.approx(87_072, abs=1e-6)


def test_day6_revenue_from_published_rounded_counts():
    # 342B·0.14 + 266B·0.55 + 168B·2.19 per million = $562,100; DeepSeek's $562,027 lies
    # inside what the counts' rounding to 1B allows.
    report = economics(DAY6_VOLUME, DAY6_PRICES, DAY6_FLEET)
    assert report.revenue_per_day == pytest.approx(562_100, abs=1e-6)
    low = economics(TokenVolume(607.5e9, 342.5e9, 167.5e9), DAY6_PRICES, DAY6_FLEET)
    high = economics(TokenVolume(608.5e9, 341.5e9, 168.5e9), DAY6_PRICES, DAY6_FLEET)
    assert low.revenue_per_day < 562_027 < high.revenue_per_day


def test_day6_published_revenue_and_margin_reproduced_exactly():
    hits = implied_cache_hit_tokens(562_027, DAY6_VOLUME, DAY6_PRICES)
    assert round(hits / 1e9) == 342  # the published (rounded) count
    assert round(100 * hits / 608e9, 1) == 56.3  # DeepSeek's published hit rate
    report = economics(TokenVolume(608e9, hits, 168e9), DAY6_PRICES, DAY6_FLEET)
    assert round(report.revenue_per_day) == 562_027
    assert round(report.cost_per_day) == 87_072
    assert int(100 * report.cost_profit_margin) == 545  # 545.47%


def test_off_peak_discount_and_payback():
    volume = TokenVolume(1e9, 0.0, 1e9)
    prices = PriceSheet(0.0, 1.0, 3.0, off_peak_discount=0.5, off_peak_share=0.5)
    fleet = Fleet(10, accelerator_hour_cost=1.0, capex_per_accelerator=1000.0)
    report = economics(volume, prices, fleet)
    assert report.revenue_per_day == pytest.approx(4000 * 0.75)
    assert report.cost_per_day == pytest.approx(240)
    assert report.payback_days == pytest.approx(10_000 / (3000 - 240))
    assert report.revenue_per_accelerator_hour == pytest.approx(3000 / 240)


def test_from_throughput_is_a_day_at_that_rate():
    volume = TokenVolume.from_throughput(100.0, 10.0, cache_hit_rate=0.5, utilization=0.5)
    assert volume.input_tokens == pytest.approx(100 * 43200)
    assert volume.cache_hit_tokens == pytest.approx(50 * 43200)
    assert volume.output_tokens == pytest.approx(10 * 43200)


@pytest.mark.parametrize("bad", [dict(input_tokens=1, cache_hit_tokens=2, output_tokens=0),
                                 dict(input_tokens=-1, cache_hit_tokens=0, output_tokens=0)])
def test_bad_volumes_raise_value_error(bad):
    with pytest.raises(ValueError):
        TokenVolume(**bad)


def test_parse_count():
    assert parse_count("608B") == 608e9
    assert parse_count("1.5T") == 1.5e12
    assert parse_count("2e9") == 2e9
    with pytest.raises(ValueError):
        parse_count("12x")


def test_cli_preset_prints_day6(capsys):
    assert main(["economics", "--preset", "deepseek-day6"]) == 0
    out = capsys.readouterr().out
    assert "$87,072" in out and "$562,100" in out and "$562,027" in out


def test_cli_bad_input_is_one_line_exit_2(capsys):
    assert main(["economics", "--input-tokens", "12x", "--output-tokens", "1",
                 "--accelerators", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("deepinfer economics: error:") and "\n" not in err


def test_cli_needs_a_fleet(capsys):
    assert main(["economics", "--input-tokens", "1B", "--output-tokens", "1B"]) == 2
    assert "--accelerators" in capsys.readouterr().err


def _day_file(tmp_path, capacity=True):
    import json
    day = {"day": {"input_tokens_per_day": 608e9, "output_tokens_per_day": 168e9,
                   "hit_rate": 0.5625, "nodes_mean": 226.75}}
    if capacity:
        day["capacity"] = {"per_accelerator": {"0.563": 6533.0, "0.960": 8854.0}}
    path = tmp_path / "day.json"
    path.write_text(json.dumps(day))
    return str(path)


def test_cli_from_a_simulated_day_with_the_seed_figures(tmp_path, capsys):
    assert main(["economics", "--from-day", _day_file(tmp_path), "--seed-figures"]) == 0
    out = capsys.readouterr().out
    assert "$87,072" in out  # 226.75 nodes x 8 GPUs x $2 x 24 h
    assert "608.00 B" in out and "56.2%" in out
    assert "> 80% margin" in out and "consistent" in out
    assert "$38 per accelerator-hour" in out and "NOT consistent" in out  # 17.7k > 8.9k tok/s
    assert "$69,984 per accelerator" in out  # the capex an 81-day payback implies


def test_cli_seed_figures_need_a_day_with_capacity(tmp_path, capsys):
    assert main(["economics", "--preset", "deepseek-day6", "--seed-figures"]) == 2
    assert "--from-day" in capsys.readouterr().err
    assert main(["economics", "--from-day", _day_file(tmp_path, capacity=False),
                 "--seed-figures"]) == 2
    assert "no capacity" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["economics", "--from-day", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert "cannot read simulated day" in err and "\n" not in err
