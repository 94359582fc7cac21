"""Messages of the EP group on top of the engine protocol (wire/engine_messages.py): rank control
from the front, and EPLB results from rank 0. Tags differ from the engine messages, so one
decoder reads both."""
from __future__ import annotations

import msgspec

from deepinfer.wire.engine_messages import EngineMessage, FrontMessage


class WakeUp(msgspec.Struct, tag=True):
    """Sent to the other ranks of a group when one gets a request: an idle rank waiting on
    its socket joins the next group step at once instead of after its idle poll."""


class ForceRebalance(msgspec.Struct, tag=True):
    """Rebalance experts at the next group step (every rank is told through the step header)."""


class EPLBStats(msgspec.Struct, tag=True):
    """After each rebalance (rank 0; the numbers are the same on every rank)."""

    step: int
    balancedness_before: list[float]  # per MoE layer
    balancedness_after: list[float]
    num_moved_slots: int
    moved_bytes: int
    duration_s: float
    redundant_expert_bytes: int
    num_rebalances: int
    expert_cpu_ms_max: float = 0.0  # per step since the previous rebalance: busiest rank
    expert_cpu_ms_mean: float = 0.0  # ... and the mean rank (CPU devices)
    plan_s: float = 0.0  # planning time (off the step path unless inside duration_s)

    @classmethod
    def of(cls, report, runtime) -> "EPLBStats":
        """From a rebalance report of `runtime` (`moe.expert_parallel.ExpertParallelRuntime`)."""
        return cls(step=report.step, balancedness_before=report.balancedness_before,
                   balancedness_after=report.balancedness_after,
                   num_moved_slots=report.num_moved_slots, moved_bytes=report.moved_bytes,
                   duration_s=report.duration_s,
                   redundant_expert_bytes=runtime.redundant_expert_bytes(),
                   num_rebalances=len(runtime.reports),
                   expert_cpu_ms_max=report.expert_cpu_ms_max,
                   expert_cpu_ms_mean=report.expert_cpu_ms_mean, plan_s=report.plan_s)


class WorkerEPLBStats(msgspec.Struct, tag=True):
    """Rank 0 of an expert-parallel decode group to the disaggregated front, after each
    rebalance (on the worker protocol, next to its WorkerReports)."""

    worker_id: str
    stats: EPLBStats


RankControl = WakeUp | ForceRebalance


def make_rank_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(FrontMessage | RankControl)


def make_front_rank_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(EngineMessage | EPLBStats)


RankInput = FrontMessage | RankControl  # front -> rank
RankOutput = EngineMessage | EPLBStats  # rank -> front
