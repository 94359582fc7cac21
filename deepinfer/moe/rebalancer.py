"""EPLB rebalance step, run by every rank of an EP group at the same step (between steps):

    window loads [layers, experts] ──all_reduce(sum)──▶ plan_placement (moe/eplb.py, pure)
      ──▶ align_to_current (relabel ranks/slots: same loads, fewest changed slots); layers
          whose balancedness would not gain MIN_BALANCEDNESS_GAIN keep their layout
      ──▶ plan_expert_moves (only slots whose expert changes) ──▶ point-to-point weight
      transfers (isend/irecv; local copies for experts the rank already holds)
      ──▶ every layer switches to the new map

All ranks plan from the same summed loads with the same deterministic planner, so they agree
on the new layout and on every transfer without further messages.

Planning takes seconds for DeepSeek-V3-sized layers, so a scheduled rebalance can plan off the
step path (`begin` / `finish`): the window is agreed at the due step, a background thread
plans (and relabels) from it while the group keeps stepping, and from a later step
(`apply_at`) the ranks all-reduce "my plan is done" after each step and apply it together at
the first step where every rank's is: no step waits for planning.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from deepinfer.moe.ep_experts import ExpertParallelExperts
from deepinfer.moe.eplb import ExpertPlacement, placement_from_phy2log, plan_placement
from deepinfer.moe.expert_moves import ExpertMove, align_to_current, plan_expert_moves

logger = logging.getLogger(__name__)

# A layer keeps its layout unless the plan balances the window at least this much better:
# plans of similar quality differ in many slots, and moving them buys nothing.
MIN_BALANCEDNESS_GAIN = 0.01


@dataclass(frozen=True)
class RebalanceReport:
    step: int
    balancedness_before: list[float]  # per MoE layer: the window's loads on the old layout
    balancedness_after: list[float]  # the same loads on the new layout
    num_moved_slots: int  # slots whose expert changed (whole group)
    moved_bytes: int  # expert bytes sent between ranks (whole group)
    duration_s: float
    # Expert CPU time per step since the last rebalance (CPU devices): busiest rank, mean rank.
    expert_cpu_ms_max: float = 0.0
    expert_cpu_ms_mean: float = 0.0
    plan_s: float = 0.0  # planning (+ relabelling): inside duration_s unless planned off-path


class _PendingPlan:
    """A plan being made in a background thread from an agreed window."""

    def __init__(self, fn, step: int, apply_at: int, loads: np.ndarray, cpu_ms: np.ndarray) -> None:
        self.step, self.apply_at, self.loads, self.cpu_ms = step, apply_at, loads, cpu_ms
        self.result = self.error = None
        self.plan_s = 0.0
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True,
                                       name="eplb-planner")
        self.thread.start()

    def _run(self, fn) -> None:
        start = time.perf_counter()
        try:
            self.result = fn(self.loads)
        except Exception as exc:  # re-raised on the step path, where the rank can report it
            self.error = exc
        self.plan_s = time.perf_counter() - start


class ExpertRebalancer:
    def __init__(self, layers: list[ExpertParallelExperts], placement: ExpertPlacement,
                 num_groups: int = 1, num_nodes: int = 1, group=None) -> None:
        self.layers = layers
        self.placement = placement
        self.num_groups = num_groups
        self.num_nodes = num_nodes
        self.group = group
        self._pending: _PendingPlan | None = None

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def rebalance(self, local_loads: np.ndarray, step: int,
                  num_steps_since: int = 1) -> RebalanceReport | None:
        """Collective: `local_loads` [layers, experts] is this rank's window. None (and nothing
        moved) when the group saw no load at all. Drops a plan still pending."""
        start = time.perf_counter()
        self._drop_pending()
        loads, cpu_ms = self._agree(local_loads, num_steps_since)
        if loads.sum() == 0:
            return None
        plan_start = time.perf_counter()
        aligned = self._plan(loads)
        return self._apply(aligned, loads, cpu_ms, step, start, time.perf_counter() - plan_start)

    def begin(self, local_loads: np.ndarray, step: int, num_steps_since: int,
              apply_at: int) -> bool:
        """Collective: agree on the window now, plan it in a background thread; `finish` at
        step `apply_at` applies it. False when the group saw no load (nothing pending)."""
        self._drop_pending()
        loads, cpu_ms = self._agree(local_loads, num_steps_since)
        if loads.sum() == 0:
            return False
        self._pending = _PendingPlan(self._plan, step, apply_at, loads, cpu_ms)
        return True

    def finish(self, step: int) -> RebalanceReport | None:
        """Collective from the step a plan is due (the same step on every rank, as is every
        later call): once every rank's thread has finished (one all-reduce of a flag per step
        until then, so no step waits for planning), move and switch."""
        pending = self._pending
        if pending is None or step < pending.apply_at:
            return None
        if dist.is_initialized():
            ready = torch.tensor([int(not pending.thread.is_alive())], dtype=torch.long,
                                 device=self._comm_device())
            dist.all_reduce(ready, group=self.group)
            if int(ready.item()) < self.layers[0].world_size:
                return None  # someone is still planning: try again after the next step
        self._pending = None
        start = time.perf_counter()
        pending.thread.join()  # one process: no peers to keep stepping with
        if pending.error is not None:
            raise pending.error
        return self._apply(pending.result, pending.loads, pending.cpu_ms, step, start,
                           pending.plan_s)

    def _drop_pending(self) -> None:
        if self._pending is not None:  # superseded (e.g. a forced rebalance): not applied
            self._pending.thread.join()
            self._pending = None

    def _agree(self, local_loads: np.ndarray, num_steps_since: int):
        """Collective: the group's summed window and every rank's expert CPU ms per step."""
        loads = torch.as_tensor(np.ascontiguousarray(local_loads), dtype=torch.long)
        cpu_ms = torch.zeros(self.layers[0].world_size, dtype=torch.float64)  # [ranks]
        spent = sum(layer.compute_cpu_s for layer in self.layers)
        cpu_ms[self.layers[0].rank] = spent * 1e3 / max(1, num_steps_since)
        for layer in self.layers:
            layer.compute_cpu_s = 0.0
        if dist.is_initialized():
            loads = loads.to(self._comm_device())
            dist.all_reduce(loads, group=self.group)
            cpu_ms = cpu_ms.to(self._comm_device())
            dist.all_reduce(cpu_ms, group=self.group)  # each rank filled its own entry
        return loads.cpu().numpy(), cpu_ms.cpu().numpy()

    def _plan(self, loads: np.ndarray) -> np.ndarray:
        """Pure (numpy, no collectives; safe off the step path while the placement is
        unchanged): the plan relabelled to the current layout; layers that would not gain
        MIN_BALANCEDNESS_GAIN keep theirs."""
        first = self.layers[0]
        current = self.placement
        planned = plan_placement(loads, first.num_physical, first.world_size, self.num_groups,
                                 self.num_nodes)
        # Relabel ranks and slots to keep what already sits in place (same balancedness).
        aligned = align_to_current(current.phy2log, planned.phy2log, first.slots_per_rank,
                                   first.world_size // self.num_nodes)
        gain = (placement_from_phy2log(aligned, first.num_experts, first.world_size)
                .balancedness(loads) - current.balancedness(loads))  # [layers]
        aligned[gain < MIN_BALANCEDNESS_GAIN] = current.phy2log[gain < MIN_BALANCEDNESS_GAIN]
        return aligned

    def _apply(self, aligned: np.ndarray, loads: np.ndarray, cpu_ms: np.ndarray, step: int,
               start: float, plan_s: float) -> RebalanceReport:
        first = self.layers[0]
        new = placement_from_phy2log(aligned, first.num_experts, first.world_size)
        before = self.placement.balancedness(loads)
        moves = plan_expert_moves(self.placement.phy2log, new.phy2log, first.slots_per_rank)
        self._apply_moves(moves)
        for i, layer in enumerate(self.layers):
            layer.set_mapping(new.phy2log[i], new.log2phy[i], new.logcnt[i])
        self.placement = new
        moved_bytes = sum(first.expert_bytes() for m in moves if m.kind == "remote")
        return RebalanceReport(step, before.tolist(), new.balancedness(loads).tolist(),
                               len(moves), moved_bytes, time.perf_counter() - start,
                               float(cpu_ms.max()), float(cpu_ms.mean()), plan_s)

    def _comm_device(self) -> torch.device:
        return self.layers[0].gate_up_proj.device

    def _apply_moves(self, moves: list[ExpertMove]) -> None:
        """Transfers first (sources read before anything is overwritten), then the writes."""
        rank, per_rank = self.layers[0].rank, self.layers[0].slots_per_rank
        ops, received = [], {}
        for move in moves:
            if move.kind != "remote":
                continue
            src, dst = move.source_slot // per_rank, move.slot // per_rank
            layer = self.layers[move.layer]
            if src == rank:
                ops.append(dist.P2POp(dist.isend, _flat_expert(layer, move.source_slot - src * per_rank),
                                      dst, self.group))
            if dst == rank:
                buf = torch.empty(_expert_nbytes(layer), dtype=torch.uint8,
                                  device=layer.gate_up_proj.device)
                ops.append(dist.P2POp(dist.irecv, buf, src, self.group))
                received[(move.layer, move.slot)] = buf
        # Local sources are read now, before any slot of this rank is overwritten.
        local = {(m.layer, m.slot): _flat_expert(self.layers[m.layer], m.source_slot - rank * per_rank)
                 for m in moves if m.kind == "local" and m.slot // per_rank == rank}
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        received.update(local)
        for (layer_idx, slot), flat in received.items():
            _write_expert(self.layers[layer_idx], slot - rank * per_rank, flat)
        for m in moves:  # copies of an expert this rank received in this same move
            if m.kind == "copy" and m.slot // per_rank == rank:
                layer = self.layers[m.layer]
                _write_expert(layer, m.slot - rank * per_rank,
                              _flat_expert(layer, m.source_slot - rank * per_rank))


def _expert_nbytes(layer: ExpertParallelExperts) -> int:
    return sum(t[0].numel() * t.element_size() for t in layer.slot_tensors())


def _flat_expert(layer: ExpertParallelExperts, local_slot: int) -> torch.Tensor:
    """A fresh contiguous copy of one slot's weights as bytes [gate_up | down | scales...]
    (safe to send/keep; any dtypes: FP8 values travel with their float32 scales)."""
    return torch.cat([t[local_slot].contiguous().view(torch.uint8).reshape(-1)
                      for t in layer.slot_tensors()])


def _write_expert(layer: ExpertParallelExperts, local_slot: int, flat: torch.Tensor) -> None:
    offset = 0
    for t in layer.slot_tensors():
        dest = t[local_slot]
        n = dest.numel() * dest.element_size()
        dest.view(torch.uint8).view(-1).copy_(flat[offset:offset + n])
        offset += n
