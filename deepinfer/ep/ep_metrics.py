"""Prometheus metrics of data-parallel / expert-parallel serving (`deepinfer:` prefix, vLLM-like
names): per-rank load, group health, and the EPLB results of each group's last rebalance, for
colocated groups (`DataParallelCollector`) and disaggregated decode groups
(`DecodeGroupEPLBCollector`) alike."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from deepinfer.wire.ep_messages import EPLBStats
from deepinfer.wire.metric_prefix import PREFIX

logger = logging.getLogger(__name__)

MAX_EPLB_HISTORY = 256


@dataclass
class GroupEPLB:
    """What the front keeps of one group's rebalances, over every incarnation of the group
    (`rank_group_handle.GroupHandle` has the same fields)."""

    index: int
    eplb: EPLBStats | None = None  # the last rebalance
    eplb_history: list[EPLBStats] = field(default_factory=list)  # the last MAX_EPLB_HISTORY
    num_rebalances: int = 0
    moved_bytes: int = 0


def record_rebalance(group, stats: EPLBStats) -> None:
    """Keep `stats` as `group`'s last rebalance (a GroupEPLB or GroupHandle) and log it."""
    group.eplb = stats
    group.eplb_history = group.eplb_history[-MAX_EPLB_HISTORY + 1:] + [stats]
    group.num_rebalances += 1
    group.moved_bytes += stats.moved_bytes
    logger.info("group %d EPLB at step %d: balancedness %.3f -> %.3f (mean of %d layers), %d "
                "slots changed, %d bytes moved, steps stalled %.1f ms (planning %.1f ms)",
                group.index, stats.step,
                _mean(stats.balancedness_before), _mean(stats.balancedness_after),
                len(stats.balancedness_after), stats.num_moved_slots, stats.moved_bytes,
                stats.duration_s * 1e3, stats.plan_s * 1e3)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 1.0


def _family(kind, name: str, documentation: str, *labels: str):
    return kind(PREFIX + name, documentation, labels=["model_name", *labels])


def eplb_families(model_name: str, groups, redundant_expert_bytes: int):
    """The EPLB metric families of `groups` (GroupEPLB-like, labelled `dp_group`)."""
    balance = _family(GaugeMetricFamily, "eplb_balancedness",
                      "Mean / max rank load of each MoE layer at the last rebalance, on the "
                      "window's loads with the old (before) and new (after) expert placement.",
                      "dp_group", "layer", "phase")
    redundant = _family(GaugeMetricFamily, "eplb_redundant_expert_bytes",
                        "Bytes the group spends on redundant expert slots.", "dp_group")
    seconds = _family(GaugeMetricFamily, "eplb_last_rebalance_seconds",
                      "Seconds the group's last rebalance stalled its steps.", "dp_group")
    plan_seconds = _family(GaugeMetricFamily, "eplb_last_plan_seconds",
                           "Planning time of the group's last rebalance (off the step path "
                           "when eplb plan_ahead_steps > 0).", "dp_group")
    count = _family(CounterMetricFamily, "eplb_rebalances", "Expert rebalances done.",
                    "dp_group")
    moved = _family(CounterMetricFamily, "eplb_moved_expert_bytes",
                    "Expert weight bytes sent between ranks by rebalances.", "dp_group")
    for g in groups:
        labels = [model_name, str(g.index)]
        count.add_metric(labels, g.num_rebalances)
        moved.add_metric(labels, g.moved_bytes)
        redundant.add_metric(labels, redundant_expert_bytes)
        if g.eplb is None:
            continue
        for layer, (before, after) in enumerate(zip(g.eplb.balancedness_before,
                                                    g.eplb.balancedness_after)):
            balance.add_metric(labels + [str(layer), "before"], before)
            balance.add_metric(labels + [str(layer), "after"], after)
        seconds.add_metric(labels, g.eplb.duration_s)
        plan_seconds.add_metric(labels, g.eplb.plan_s)
    return [balance, redundant, seconds, plan_seconds, count, moved]


class DataParallelCollector:
    """Colocated groups (`DataParallelClient`): rank loads, group health, EPLB."""

    def __init__(self, client, model_name: str) -> None:
        self.client = client
        self.model_name = model_name

    def collect(self):
        yield from self._ranks()
        yield from eplb_families(self.model_name, self.client.groups,
                                 self.client.redundant_expert_bytes)

    def _ranks(self):
        m = self.model_name
        running = _family(GaugeMetricFamily, "dp_rank_num_requests_running",
                          "Requests in each rank's running batch.", "dp_rank")
        waiting = _family(GaugeMetricFamily, "dp_rank_num_requests_waiting",
                          "Requests waiting in each rank's scheduler.", "dp_rank")
        kv = _family(GaugeMetricFamily, "dp_rank_kv_cache_usage_perc",
                     "Fraction of each rank's KV-cache blocks in use (0-1).", "dp_rank")
        for h in self.client.ranks:
            labels = [m, str(h.global_rank)]
            running.add_metric(labels, h.stats.num_running)
            waiting.add_metric(labels, h.stats.num_waiting)
            kv.add_metric(labels, h.stats.kv_cache_usage)
        healthy = _family(GaugeMetricFamily, "dp_group_healthy",
                          "1 while the group is in routing, 0 while it is down.", "dp_group")
        for g in self.client.groups:
            healthy.add_metric([m, str(g.index)], 1.0 if g.healthy else 0.0)
        yield from (running, waiting, kv, healthy)


class DecodeGroupEPLBCollector:
    """Disaggregated decode groups (`EPDisaggClient`): EPLB per decode group (each rank's load
    is a decode worker's, in the cluster metrics)."""

    def __init__(self, client) -> None:
        self.client = client

    def collect(self):
        yield from eplb_families(self.client.model_name, self.client.decode_group_eplb,
                                 self.client.redundant_expert_bytes)
