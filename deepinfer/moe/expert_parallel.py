"""One rank's view of an expert-parallel model: its MoE layers swapped for
`ExpertParallelExperts`, the empty step, and load recording + EPLB between steps.

Lockstep contract (the rank loop keeps it): every rank of the group calls, per group step,
either the model forward (which runs each MoE layer's dispatch/combine once, in layer order)
or `run_empty_step()` (the same collectives with no tokens), then `end_step()`.
"""
from __future__ import annotations

import logging

import numpy as np
import torch
from torch import nn

from deepinfer.moe.dispatch import make_dispatcher
from deepinfer.moe.ep_experts import ExpertParallelExperts, ForwardProgress
from deepinfer.moe.eplb import balancedness, placement_from_phy2log
from deepinfer.moe.eplb_config import EPLBConfig
from deepinfer.moe.layer import SparseMoEBlock
from deepinfer.moe.load_recorder import ExpertLoadRecorder
from deepinfer.moe.rebalancer import ExpertRebalancer, RebalanceReport

logger = logging.getLogger(__name__)


def moe_blocks(model: nn.Module) -> list[SparseMoEBlock]:
    return [m for m in model.modules() if isinstance(m, SparseMoEBlock)]


class ExpertParallelRuntime:
    def __init__(self, model: nn.Module, rank: int, world_size: int, dispatcher: str = "alltoall",
                 eplb: EPLBConfig | None = None, num_redundant_experts: int = 0,
                 group=None, load_slots: bool = True) -> None:
        """`load_slots`: copy each rank's slots from the model's full expert stacks (loaded);
        False when the stacks were never filled and the caller loads only the slots'
        experts from the checkpoint (ep/rank_weights.py)."""
        blocks = moe_blocks(model)
        if not blocks:
            raise ValueError("expert parallelism needs a MoE model (no sparse MoE layer found)")
        config = blocks[0].config
        self.num_logical = config.num_experts
        self.num_physical = self.num_logical + num_redundant_experts
        if self.num_physical % world_size:
            raise ValueError(f"{self.num_logical} experts + {num_redundant_experts} redundant = "
                             f"{self.num_physical} slots do not divide over {world_size} ranks")
        self.rank, self.world_size = rank, world_size
        self.top_k = config.num_experts_per_tok
        self.eplb = eplb
        self.num_steps = 0  # group steps (identical on every rank)
        self._last_rebalance_step = 0
        self.reports: list[RebalanceReport] = []
        initial = np.tile(np.arange(self.num_physical) % self.num_logical, (len(blocks), 1))
        placement = placement_from_phy2log(initial, self.num_logical, world_size)
        slots_per_rank = self.num_physical // world_size
        comm = make_dispatcher(dispatcher, rank, world_size, slots_per_rank, group)
        self.layers: list[ExpertParallelExperts] = []
        self.progress = ForwardProgress()
        # An FP8 checkpoint's slots hold its FP8 experts (filled by ep/rank_weights.py).
        quant = getattr(getattr(model, "config", None), "quantization", None)
        fp8_block = None if quant is None else quant.weight_block_size
        if fp8_block is not None and load_slots:
            raise ValueError("FP8 expert slots are filled from the checkpoint (load_slots=False)")
        for i, block in enumerate(blocks):
            full = block.experts
            hidden = full.gate_up_proj.shape[2]
            self.dtype = full.gate_up_proj.dtype  # the activations' (the model's) dtype
            with torch.device(full.gate_up_proj.device):
                layer = ExpertParallelExperts(self.num_logical, self.num_physical, rank, world_size,
                                              hidden, full.intermediate_size,
                                              full.gate_up_proj.dtype, comm, fp8_block)
            layer.set_mapping(placement.phy2log[i], placement.log2phy[i], placement.logcnt[i])
            if load_slots:
                layer.load_local_slots(full.gate_up_proj, full.down_proj)
            layer.progress = self.progress
            block.experts = layer  # the full stack is dropped here
            self.layers.append(layer)
        self.hidden_size = hidden
        self.recorder = ExpertLoadRecorder(len(blocks), self.num_logical, self.num_physical,
                                           eplb.window_size) if eplb else None
        self.rebalancer = ExpertRebalancer(self.layers, placement,
                                           num_groups=max(1, config.n_group), group=group)

    @property
    def placement(self):
        return self.rebalancer.placement

    def redundant_expert_bytes(self) -> int:
        """Bytes the whole group spends on slots beyond one per logical expert."""
        layer = self.layers[0]
        return (self.num_physical - self.num_logical) * layer.expert_bytes() * len(self.layers)

    @torch.inference_mode()
    def run_empty_step(self) -> None:
        for layer in self.layers:
            layer.run_empty(self.hidden_size, self.dtype, self.top_k)

    def begin_forward(self) -> None:
        self.progress.layers_done, self.progress.in_collective = 0, False

    @torch.inference_mode()
    def finish_failed_forward(self) -> bool:
        """After this rank's forward raised (since `begin_forward`): run the MoE layers it did
        not reach with no tokens, so its peers' forwards complete. False when it raised inside
        a layer's dispatch/combine: the group's collectives can no longer be matched."""
        if self.progress.in_collective:
            return False
        for layer in self.layers[self.progress.layers_done:]:
            layer.run_empty(self.hidden_size, self.dtype, self.top_k)
        return True

    def discard_step_loads(self) -> None:
        """A failed step counts no load (its requests are recomputed)."""
        for layer in self.layers:
            layer.slot_load.zero_()

    def end_step(self, force_rebalance: bool = False) -> RebalanceReport | None:
        """After every group step (forward or empty): record loads; rebalance on schedule."""
        self.num_steps += 1
        loads = torch.stack([layer.take_slot_load() for layer in self.layers]).cpu().numpy()
        if self.recorder is None:
            return None
        self.recorder.record(loads, self.placement.phy2log)
        if self.eplb.log_balancedness:
            self._log_step_balancedness(loads)
        due = self.num_steps % self.eplb.step_interval == 0
        ahead = self.eplb.plan_ahead
        if force_rebalance or (due and ahead == 0):
            return self.rebalance_now()
        report = self.rebalancer.finish(self.num_steps)  # planned off the step path, due now
        if report is not None:
            self._record(report)
        if due and not self.rebalancer.pending:
            self.rebalancer.begin(self.recorder.logical_loads(), self.num_steps,
                                  self.num_steps - self._last_rebalance_step,
                                  apply_at=self.num_steps + ahead)
            self._last_rebalance_step = self.num_steps
        return report

    def _log_step_balancedness(self, slot_loads: np.ndarray) -> None:
        """Collective: this step's group-wide rank loads (vLLM's log_balancedness)."""
        import torch.distributed as dist
        total = torch.as_tensor(slot_loads)
        if dist.is_initialized():
            total = total.to(self.layers[0].slot_load.device)
            dist.all_reduce(total, group=self.rebalancer.group)
        per_rank = total.cpu().numpy().reshape(len(self.layers), self.world_size, -1).sum(-1)
        if self.rank == 0:
            logger.info("EPLB step %d: balancedness %.3f (mean over %d layers)", self.num_steps,
                        balancedness(per_rank).mean(), len(self.layers))

    def rebalance_now(self) -> RebalanceReport | None:
        """Collective (every rank at the same point): plan from the window, move, switch."""
        if self.recorder is None:
            return None
        report = self.rebalancer.rebalance(self.recorder.logical_loads(), self.num_steps,
                                           self.num_steps - self._last_rebalance_step)
        self._last_rebalance_step = self.num_steps
        if report is not None:
            self._record(report)
        return report

    def _record(self, report: RebalanceReport) -> None:
        self.reports.append(report)
        if self.rank == 0:
            logger.info("EPLB step %d: balancedness %.3f -> %.3f (mean over %d layers), "
                        "%d slots changed, %d bytes moved, steps stalled %.1f ms (planning "
                        "%.1f ms)", report.step, np.mean(report.balancedness_before),
                        np.mean(report.balancedness_after), len(self.layers),
                        report.num_moved_slots, report.moved_bytes, report.duration_s * 1e3,
                        report.plan_s * 1e3)
