"""The engine loop of one rank of an EP group: the colocated `EngineLoop`, stepped in lockstep.

Every iteration starts with a step header, one all-reduce of three small ints over the group:

    [ranks with work, ranks asked to shut down, ranks asked to rebalance]

so that every rank takes the same branch: all idle -> nobody runs a step; any work -> every
rank runs one step (its own batch, or an empty step with the same MoE collectives); any
shutdown -> all leave together; any rebalance request -> all rebalance at the same step.
Nothing in the loop waits on the front; a collective that waits on a dead or stuck peer fails
after the group's timeout and the rank exits (the front then takes the group out of routing).
A step that raises on one rank fails only its culprit request(s), agreed by the whole group
(ep/lockstep_faults.py); the group goes on.
"""
from __future__ import annotations

import logging
import os
import time

from deepinfer.ep.lockstep_faults import LockstepStepFaults
from deepinfer.wire.ep_messages import EPLBStats, ForceRebalance, RankInput, WakeUp
from deepinfer.ep.process_group import RankGroup
from deepinfer.moe.expert_parallel import ExpertParallelRuntime
from deepinfer.cluster.engine_proc import IDLE_STATS_PERIOD_S, EngineLoop

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 100  # an idle group re-agrees this often (WakeUp cuts the wait short)


class RankLoop(EngineLoop):
    def __init__(self, engine, runtime: ExpertParallelRuntime, rank_group: RankGroup,
                 input_socket, output_socket, parent_pid: int | None = None,
                 endpoints: tuple[str, str] = ("", "")) -> None:
        super().__init__(engine, input_socket, output_socket, parent_pid, endpoints,
                         input_type=RankInput)
        self.runtime = runtime
        self.rank_group = rank_group
        self.step_faults = LockstepStepFaults(engine, runtime, rank_group)
        self._shutdown = False
        self._rebalance = False
        self._group_busy = False

    def run(self) -> None:
        while True:
            busy = self.engine.has_unfinished_requests()
            wait = 0 if busy or self._group_busy else IDLE_POLL_MS
            if not self._drain_inputs(wait):
                self._shutdown = True
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                logger.warning("front process is gone; rank %d leaving", self.rank_group.rank)
                self._shutdown = True
            busy = self.engine.has_unfinished_requests()
            num_busy, num_shutdown, num_rebalance = self.rank_group.all_reduce_cpu(
                [int(busy), int(self._shutdown), int(self._rebalance)])
            self._rebalance = False
            if num_shutdown:
                return
            self._group_busy = num_busy > 0
            if self._group_busy:
                self._step(busy, bool(num_rebalance))
            else:
                if num_rebalance:
                    self._report(self.runtime.rebalance_now())
                if self._pending_errors or self._stats_dirty or \
                        time.monotonic() - self._last_stats_time > IDLE_STATS_PERIOD_S:
                    self._send_outputs([])

    def _step(self, busy: bool, force_rebalance: bool) -> None:
        if busy:
            outputs = self.engine.step()  # an empty schedule runs the empty step (runner hook)
            self._take_failures()
            deltas = [self.tracker.to_delta(o) for o in outputs]
        else:
            self.step_faults.run_empty_step()
            deltas = []
        self._report(self.runtime.end_step(force_rebalance))
        if busy or deltas or self._pending_errors or self._stats_dirty or \
                time.monotonic() - self._last_stats_time > IDLE_STATS_PERIOD_S:
            self._send_outputs(deltas)

    def _report(self, report) -> None:
        if report is None or self.rank_group.rank != 0:
            return
        self.output_socket.send(self.encoder.encode(EPLBStats.of(report, self.runtime)),
                                copy=False)

    def _on_message(self, message) -> bool:
        if isinstance(message, WakeUp):
            return True
        if isinstance(message, ForceRebalance):
            self._rebalance = True
            return True
        return super()._on_message(message)
