"""Prometheus metrics of data-parallel / expert-parallel serving (`deepinfer:` prefix, vLLM-like
names): per-rank load, group health, and the EPLB results of each group's last rebalance."""
from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from deepinfer.server.metrics import PREFIX


class DataParallelCollector:
    def __init__(self, client, model_name: str) -> None:
        self.client = client
        self.model_name = model_name

    def collect(self):
        yield from self._ranks()
        yield from self._eplb()

    def _ranks(self):
        m = self.model_name
        running = GaugeMetricFamily(PREFIX + "dp_rank_num_requests_running",
                                    "Requests in each rank's running batch.",
                                    labels=["model_name", "dp_rank"])
        waiting = GaugeMetricFamily(PREFIX + "dp_rank_num_requests_waiting",
                                    "Requests waiting in each rank's scheduler.",
                                    labels=["model_name", "dp_rank"])
        kv = GaugeMetricFamily(PREFIX + "dp_rank_kv_cache_usage_perc",
                               "Fraction of each rank's KV-cache blocks in use (0-1).",
                               labels=["model_name", "dp_rank"])
        for h in self.client.ranks:
            labels = [m, str(h.global_rank)]
            running.add_metric(labels, h.stats.num_running)
            waiting.add_metric(labels, h.stats.num_waiting)
            kv.add_metric(labels, h.stats.kv_cache_usage)
        healthy = GaugeMetricFamily(PREFIX + "dp_group_healthy",
                                    "1 while the group is in routing, 0 while it is down.",
                                    labels=["model_name", "dp_group"])
        for g in self.client.groups:
            healthy.add_metric([m, str(g.index)], 1.0 if g.healthy else 0.0)
        yield from (running, waiting, kv, healthy)

    def _eplb(self):
        m = self.model_name
        balance = GaugeMetricFamily(
            PREFIX + "eplb_balancedness",
            "Mean / max rank load of each MoE layer at the last rebalance, on the window's "
            "loads with the old (before) and new (after) expert placement.",
            labels=["model_name", "dp_group", "layer", "phase"])
        redundant = GaugeMetricFamily(PREFIX + "eplb_redundant_expert_bytes",
                                      "Bytes the group spends on redundant expert slots.",
                                      labels=["model_name", "dp_group"])
        seconds = GaugeMetricFamily(PREFIX + "eplb_last_rebalance_seconds",
                                    "Duration of the group's last rebalance.",
                                    labels=["model_name", "dp_group"])
        count = CounterMetricFamily(PREFIX + "eplb_rebalances", "Expert rebalances done.",
                                    labels=["model_name", "dp_group"])
        moved = CounterMetricFamily(PREFIX + "eplb_moved_expert_bytes",
                                    "Expert weight bytes sent between ranks by rebalances.",
                                    labels=["model_name", "dp_group"])
        for g in self.client.groups:
            labels = [m, str(g.index)]
            count.add_metric(labels, g.num_rebalances)
            moved.add_metric(labels, g.moved_bytes)
            redundant.add_metric(labels, self.client.redundant_expert_bytes)
            if g.eplb is None:
                continue
            for layer, (before, after) in enumerate(zip(g.eplb.balancedness_before,
                                                        g.eplb.balancedness_after)):
                balance.add_metric(labels + [str(layer), "before"], before)
                balance.add_metric(labels + [str(layer), "after"], after)
            seconds.add_metric(labels, g.eplb.duration_s)
        yield from (balance, redundant, seconds, count, moved)
