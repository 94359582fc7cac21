"""A day of DeepSeek's V3/R1 service as published on day 6, hour by hour: demand, nodes, and
the per-node averages a simulated day gives against the published ones. Pure.

Read off the day-6 overview (deepseek-ai/open-infra-index, 202502OpenSourceWeek/day_6_*.md and
its two figures), 2025-02-27 12:00 to 02-28 12:00 UTC+8:

  nodes      the "H800 Node Count" step curve: 278 from 12:00 to 00:00 and after 08:30, steps
             of 30 nodes down to 68 between 03:30 and 06:30 (`NODE_STEPS`); its time average is
             226.75, the published figure, exactly
  demand     the "Cost and Theoretical Income" bars: list-price income per hour (k$, sum 562.0
             against the published $562,027); with one token mix all day, each hour's tokens
             are that share of 608B input (56.3% hits) and 168B output
  split      each 30-node step is one decode unit (18 nodes, EP144) and three prefill units
             (4 nodes, EP32) on a base of 32 prefill + 36 decode nodes: then the day averages
             95.5 prefill and 131.25 decode nodes, which are the published per-node averages
             back-computed (608B / 86,400 s / 73.7k = 95.5; 168B / 86,400 / 14.8k = 131.4).
             An inference, stated, that the published numbers fit to 0.1%.
  requests   mean KV length per output token 4,989 with input : output = 608 : 168 gives
             1,211 output and 4,384 input tokens per request (p + o / 2 = 4,989, p / o = 3.62)

The simulated per-node day average is the tokens the simulated nodes delivered over the node-
seconds the curve gives each role: equal to the published average exactly when the simulated
nodes keep up with every hour's demand, below it when they do not. What the simulation adds is
whether they keep up, at what utilisation, TTFT and per-user decode speed (published: 20-22
tok/s).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

# (hours after 12:00, nodes from then on) - the node-count figure
NODE_STEPS = ((0.0, 278), (12.0, 218), (13.25, 188), (14.0, 158), (14.75, 128), (15.0, 98),
              (15.5, 68), (18.5, 98), (19.0, 128), (19.5, 188), (20.0, 218), (20.5, 278))
# list-price income per hour from 12:00, k$ - the income figure
HOURLY_INCOME_K = (27.0, 28.5, 30.4, 31.0, 30.4, 27.8, 26.8, 29.6, 30.7, 30.8, 31.0, 29.8,
                   21.7, 18.0, 13.2, 8.0, 6.4, 6.4, 8.0, 13.7, 23.1, 29.4, 30.4, 29.9)
INPUT_TOKENS, HIT_TOKENS, OUTPUT_TOKENS = 608e9, 342e9, 168e9
PUBLISHED = {"nodes_mean": 226.75, "nodes_peak": 278, "input_tok_s_per_prefill_node": 73_700,
             "output_tok_s_per_decode_node": 14_800, "user_tok_s": (20.0, 22.0),
             "kv_len_per_output_token": 4_989, "hit_rate": 0.563}
BASE_NODES, STEP_NODES = 68, 30
BASE_PREFILL, BASE_DECODE, STEP_PREFILL, STEP_DECODE = 32, 36, 12, 18


def nodes_at(hour: float) -> int:
    """Nodes in service `hour` hours after 12:00 (0 <= hour < 24)."""
    current = NODE_STEPS[0][1]
    for start, nodes in NODE_STEPS:
        if hour >= start:
            current = nodes
    return current


def split_nodes(nodes: float) -> tuple[float, float]:
    """(prefill, decode) nodes: the base plus whole 30-node steps of 12 + 18 (see module)."""
    steps = (nodes - BASE_NODES) / STEP_NODES
    return BASE_PREFILL + STEP_PREFILL * steps, BASE_DECODE + STEP_DECODE * steps


def request_shape(kv_per_output: float = 4989.0) -> tuple[float, float]:
    """(input, output) tokens per request from the published mix and KV length."""
    ratio = INPUT_TOKENS / OUTPUT_TOKENS
    output = kv_per_output / (ratio + 0.5)
    return ratio * output, output


@dataclass(frozen=True)
class HourLoad:
    hour: int  # hours after 12:00
    clock: str  # "12:00"
    nodes: float  # time average over the hour
    prefill_nodes: float
    decode_nodes: float
    input_tok_s: float  # the whole service's demand in this hour
    output_tok_s: float

    @property
    def input_per_prefill_node(self) -> float:
        return self.input_tok_s / self.prefill_nodes

    @property
    def output_per_decode_node(self) -> float:
        return self.output_tok_s / self.decode_nodes


def day_loads(resolution_per_hour: int = 60) -> list[HourLoad]:
    """The 24 hours' demand and node counts (nodes averaged at minute resolution)."""
    total = sum(HOURLY_INCOME_K)
    out = []
    for h, income in enumerate(HOURLY_INCOME_K):
        samples = [nodes_at(h + (i + 0.5) / resolution_per_hour)
                   for i in range(resolution_per_hour)]
        nodes = sum(samples) / len(samples)
        prefill = sum(split_nodes(n)[0] for n in samples) / len(samples)
        decode = sum(split_nodes(n)[1] for n in samples) / len(samples)
        share = income / total
        out.append(HourLoad(h, f"{(12 + h) % 24:02d}:00", nodes, prefill, decode,
                            INPUT_TOKENS * share / 3600.0, OUTPUT_TOKENS * share / 3600.0))
    return out


@dataclass(frozen=True)
class HourResult:
    """One simulated hour, per node of each role, and its latency."""

    load: HourLoad
    input_tok_s_per_prefill_node: float  # delivered
    output_tok_s_per_decode_node: float  # delivered
    prefill_utilization: float
    decode_utilization: float
    ttft_p50_ms: float | None
    tpot_p50_ms: float | None  # per emitted token (MTP counted)
    decode_batch_mean: float  # sequences per decode node

    def to_dict(self) -> dict:
        return {**asdict(self), "load": asdict(self.load)}


def day_averages(hours: list[HourResult]) -> dict:
    """Per-node averages over the day (tokens / node-seconds per role), the per-user decode
    speed (weighted by output tokens) and the share of demand the simulated nodes carried."""
    prefill_s = sum(h.load.prefill_nodes for h in hours)
    decode_s = sum(h.load.decode_nodes for h in hours)
    delivered_in = sum(h.input_tok_s_per_prefill_node * h.load.prefill_nodes for h in hours)
    delivered_out = sum(h.output_tok_s_per_decode_node * h.load.decode_nodes for h in hours)
    demand_in = sum(h.load.input_tok_s for h in hours)
    demand_out = sum(h.load.output_tok_s for h in hours)
    weighted = [(h.load.output_tok_s, 1e3 / h.tpot_p50_ms) for h in hours if h.tpot_p50_ms]
    user = (sum(w * v for w, v in weighted) / sum(w for w, _ in weighted)) if weighted else None
    return {
        "input_tok_s_per_prefill_node": delivered_in / prefill_s,
        "output_tok_s_per_decode_node": delivered_out / decode_s,
        "input_carried": delivered_in / demand_in, "output_carried": delivered_out / demand_out,
        "user_tok_s": user,
        "prefill_utilization": sum(h.prefill_utilization * h.load.prefill_nodes
                                   for h in hours) / prefill_s,
        "decode_utilization": sum(h.decode_utilization * h.load.decode_nodes
                                  for h in hours) / decode_s,
        "nodes_mean": sum(h.load.nodes for h in hours) / len(hours),
        "prefill_nodes_mean": prefill_s / len(hours), "decode_nodes_mean": decode_s / len(hours),
        "input_tokens_per_day": delivered_in * 3600.0,
        "output_tokens_per_day": delivered_out * 3600.0}
