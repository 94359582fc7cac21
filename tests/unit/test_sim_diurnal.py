"""DeepSeek's day 6: the published curves read back exactly, a reduced simulated day against
the published per-node averages (`benchmarks/sim_deepseek_day.py`), and the seed's economics
checked against it."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from deepinfer.sim import published_deployments as published
from deepinfer.sim.deployments import calibrate
from deepinfer.sim.diurnal import (HOURLY_INCOME_K, PUBLISHED, day_averages, day_loads,
                                   nodes_at, request_shape, split_nodes)
from deepinfer.sim.economics import PriceSheet
from deepinfer.sim.seed_economics import blended_price_per_token, seed_checks

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.sim_deepseek_day import simulate_day  # noqa: E402


def test_published_curves_read_back_exactly():
    loads = day_loads()
    assert sum(l.nodes for l in loads) / 24 == pytest.approx(226.75)
    assert max(nodes_at(h / 4) for h in range(96)) == 278
    assert sum(HOURLY_INCOME_K) == pytest.approx(562.0, abs=0.05)  # $562,027 published
    prefill = sum(l.prefill_nodes for l in loads)
    decode = sum(l.decode_nodes for l in loads)
    # the split gives the published per-node averages back (they are the day's tokens over
    # each role's node-seconds)
    assert sum(l.input_tok_s for l in loads) / prefill == pytest.approx(73_700, rel=0.002)
    assert sum(l.output_tok_s for l in loads) / decode == pytest.approx(14_800, rel=0.002)
    assert split_nodes(68) == (32, 36) and split_nodes(278) == (116, 162)
    prompt, output = request_shape()
    assert prompt + output / 2 == pytest.approx(4989)
    assert prompt / output == pytest.approx(608 / 168)


@pytest.fixture(scope="module")
def reduced_day():
    """Two hours (the night trough and the afternoon peak), short windows."""
    scale = calibrate(published.CALIBRATION)["efficiency_scale"]
    hours, _ = simulate_day(scale, window_s=40.0, hours=[4, 15])
    return hours


def test_simulated_nodes_carry_the_published_per_node_load(reduced_day):
    day = day_averages(reduced_day)
    loads = [h.load for h in reduced_day]
    demand_in = sum(l.input_tok_s for l in loads) / sum(l.prefill_nodes for l in loads)
    demand_out = sum(l.output_tok_s for l in loads) / sum(l.decode_nodes for l in loads)
    assert day["input_tok_s_per_prefill_node"] == pytest.approx(demand_in, rel=0.15)
    assert day["output_tok_s_per_decode_node"] == pytest.approx(demand_out, rel=0.15)
    for hour in reduced_day:  # neither pool idles nor overflows
        assert 0.2 < hour.prefill_utilization < 1.0
        assert 0.2 < hour.decode_utilization <= 1.0


def test_seed_checks_against_the_simulated_throughput(reduced_day):
    day = day_averages(reduced_day)
    per_acc = (day["input_tok_s_per_prefill_node"] * day["prefill_nodes_mean"]
               + day["output_tok_s_per_decode_node"] * day["decode_nodes_mean"]) \
        / (8 * day["nodes_mean"])
    checks = {c.claim: c for c in seed_checks(capacity_tok_s_per_acc=2 * per_acc,
                                              day_tok_s_per_acc=per_acc)}
    assert checks["> 80% margin"].consistent is True  # $38 vs $2 an hour
    assert "$69,984" in checks["81-day payback"].implies  # 81 x 36 x 24
    # $38/h at 96% hits needs ~17.7k tok/s per accelerator: beyond an H800 node's share
    assert checks["$38 per accelerator-hour"].consistent is False
    price = blended_price_per_token(PriceSheet(), 0.563)
    assert 562_027 / 776e9 == pytest.approx(price, rel=0.01)  # day 6's blended price
