"""Expert-parallel drop-in for `MoEExperts`: this rank's physical expert slots, the mapping from
logical experts to slots, and a per-slot token counter for the load balancer.

    slot p (global)  = rank * slots_per_rank + local slot       (rank-major, as moe/eplb.py)
    gate_up_proj [S, 2I, H], down_proj [S, H, I]                this rank's S slots only
    log2phy [E, max_replicas], logcnt [E]                       every rank holds the whole map

A token's pair (token t, logical expert e) goes to replica (t + rank) % logcnt[e] of e: the
tokens of a replicated expert spread over its replicas, deterministically. Replicas are exact
copies, so which one computes a pair never changes the result.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deepinfer.moe.dispatch import ExpertBatch, TokenDispatcher


@dataclass
class ForwardProgress:
    """How far this rank's forward got through the step's MoE collectives, so a forward that
    raises can join the layers it did not reach (`ExpertParallelRuntime.finish_failed_forward`)."""

    layers_done: int = 0
    in_collective: bool = False  # raised between a layer's dispatch and its combine


class ExpertParallelExperts(nn.Module):
    def __init__(self, num_logical: int, num_physical: int, rank: int, world_size: int,
                 hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                 dispatcher: TokenDispatcher, fp8_block: tuple[int, int] | None = None) -> None:
        """`fp8_block`: the slots hold block-scaled FP8 weights (float8_e4m3fn values and
        float32 `gate_up_scale` / `down_scale` per block) instead of `dtype` ones."""
        super().__init__()
        if num_physical % world_size:
            raise ValueError(f"{num_physical} physical experts do not divide over {world_size} ranks")
        self.num_experts = num_logical  # what MoEExperts callers read
        self.num_physical = num_physical
        self.rank = rank
        self.world_size = world_size
        self.slots_per_rank = num_physical // world_size
        self.intermediate_size = intermediate_size
        self.dispatcher = dispatcher
        dev = torch.get_default_device()
        s = self.slots_per_rank
        self.fp8_block = fp8_block
        self._fp8_views: list | None = None
        # FP8 slots: the quantized linear kernel (runtime/cpu_quant_linear.py), set by the
        # loader once it passed its self-test; None: dequantize-then-matmul.
        self.kernel = None
        if fp8_block is not None:
            dtype = torch.float8_e4m3fn
            if intermediate_size % fp8_block[0]:
                raise ValueError(f"expert parallelism with FP8 experts needs moe_intermediate_size "
                                 f"({intermediate_size}) to be a multiple of the weight block "
                                 f"({fp8_block[0]}): each slot stacks gate and up")
        self.gate_up_proj = nn.Parameter(torch.empty(s, 2 * intermediate_size, hidden_size, dtype=dtype,
                                                     device=dev), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(s, hidden_size, intermediate_size, dtype=dtype,
                                                  device=dev), requires_grad=False)
        if fp8_block is not None:
            def blocks(rows: int, cols: int) -> list[int]:
                return [s, -(-rows // fp8_block[0]), -(-cols // fp8_block[1])]
            self.gate_up_scale = nn.Parameter(torch.empty(
                blocks(2 * intermediate_size, hidden_size), device=dev), requires_grad=False)
            self.down_scale = nn.Parameter(torch.empty(
                blocks(hidden_size, intermediate_size), device=dev), requires_grad=False)
        self.register_buffer("log2phy", torch.zeros(num_logical, 1, dtype=torch.long, device=dev),
                             persistent=False)
        self.register_buffer("logcnt", torch.ones(num_logical, dtype=torch.long, device=dev),
                             persistent=False)
        self.register_buffer("slot_load", torch.zeros(num_physical, dtype=torch.long, device=dev),
                             persistent=False)
        self.phy2log = np.arange(num_physical) % num_logical  # host copy of the current map
        # CPU seconds this rank spent in its experts (thread time: immune to time slicing), the
        # quantity EPLB balances; read and reset by the runtime at each rebalance.
        self.compute_cpu_s = 0.0
        self.progress: ForwardProgress | None = None  # shared by a runtime's layers

    # ---- placement ---------------------------------------------------------------------------
    @property
    def local_slot_range(self) -> range:
        return range(self.rank * self.slots_per_rank, (self.rank + 1) * self.slots_per_rank)

    def set_mapping(self, phy2log: np.ndarray, log2phy: np.ndarray, logcnt: np.ndarray) -> None:
        """Switch the routing map (weights must already match `phy2log` on this rank)."""
        dev = self.logcnt.device
        self.phy2log = np.asarray(phy2log, dtype=np.int64).copy()
        self.log2phy = torch.as_tensor(np.asarray(log2phy), dtype=torch.long, device=dev)
        self.logcnt = torch.as_tensor(np.asarray(logcnt), dtype=torch.long, device=dev)

    def load_local_slots(self, gate_up_proj: Tensor, down_proj: Tensor) -> None:
        """Fill this rank's slots from the full stacked expert weights [E, ...] (at load)."""
        experts = torch.as_tensor(self.phy2log[self.local_slot_range.start:self.local_slot_range.stop],
                                  device=gate_up_proj.device)
        self.gate_up_proj.copy_(gate_up_proj.index_select(0, experts))
        self.down_proj.copy_(down_proj.index_select(0, experts))

    def slot_tensors(self) -> list[Tensor]:
        """The stacked per-slot tensors [slots, ...] that make up an expert (what a move copies)."""
        if self.fp8_block is None:
            return [self.gate_up_proj, self.down_proj]
        return [self.gate_up_proj, self.down_proj, self.gate_up_scale, self.down_scale]

    def expert_bytes(self) -> int:
        """Bytes of one expert's weights."""
        return sum(t[0].numel() * t.element_size() for t in self.slot_tensors())

    def load_quantized_experts(self, by_expert: dict) -> None:
        """Fill this rank's FP8 slots from {logical expert: {"gate_proj", "up_proj" |
        "gate_up_proj", "down_proj": QuantizedWeight}} (every expert, or at least the local
        slots' ones)."""
        from deepinfer.quant.fused_quantized import stack_rows

        start = self.local_slot_range.start
        for slot in range(self.slots_per_rank):
            w = by_expert[int(self.phy2log[start + slot])]
            gate_up = w["gate_up_proj"] if "gate_up_proj" in w else stack_rows(
                [w["gate_proj"], w["up_proj"]])
            for data, scale, q in ((self.gate_up_proj, self.gate_up_scale, gate_up),
                                   (self.down_proj, self.down_scale, w["down_proj"])):
                if q.shape != tuple(data.shape[1:]) or tuple(q.scale.shape) != tuple(scale.shape[1:]):
                    raise ValueError(f"FP8 expert {self.phy2log[start + slot]} has shape "
                                     f"{list(q.shape)}, expected {list(data.shape[1:])}")
                data[slot].copy_(q.data)
                scale[slot].copy_(q.scale)

    def _slot_linear(self, x: Tensor, which: int, slot: int) -> Tensor:
        """x @ W.T for slot `slot`'s gate_up (which=0) or down (1) weight. An FP8 slot goes
        through the quantized kernel when one is set and takes it, else is dequantized."""
        if self.fp8_block is None:
            return F.linear(x, (self.gate_up_proj, self.down_proj)[which][slot])
        if self._fp8_views is None:  # views of the slot tensors: moves write in place
            from deepinfer.quant.quantized_weight import FP8_BLOCK, QuantizedWeight
            self._fp8_views = [tuple(
                QuantizedWeight(FP8_BLOCK, data.shape[1], data.shape[2], data[s], scale[s],
                                self.fp8_block)
                for data, scale in ((self.gate_up_proj, self.gate_up_scale),
                                    (self.down_proj, self.down_scale)))
                for s in range(self.slots_per_rank)]
        weight = self._fp8_views[slot][which]
        out = None if self.kernel is None else self.kernel.linear(x, weight, None)
        return out if out is not None else F.linear(x, weight.dequantize(x.dtype))

    def take_slot_load(self) -> Tensor:
        """Pairs routed to each physical slot since the last call [num_physical]; resets."""
        load = self.slot_load.clone()
        self.slot_load.zero_()
        return load

    # ---- forward -----------------------------------------------------------------------------
    def physical_slots(self, topk_ids: Tensor) -> Tensor:
        """topk_ids [T, k] logical -> [T, k] physical slots (replicas spread by token)."""
        num_tokens = topk_ids.shape[0]
        token = torch.arange(num_tokens, device=topk_ids.device).unsqueeze(1) + self.rank  # [T, 1]
        replica = token % self.logcnt[topk_ids]  # [T, k]
        return self.log2phy[topk_ids, replica]

    def forward(self, x: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
        """x [T, hidden], topk_weights [T, k] (float), topk_ids [T, k] -> [T, hidden]."""
        slots = self.physical_slots(topk_ids)  # [T, k]
        if slots.numel():
            self.slot_load += torch.bincount(slots.reshape(-1), minlength=self.num_physical)
        progress = self.progress
        if progress is not None:
            progress.in_collective = True
        batch, handle = self.dispatcher.dispatch(x, slots, topk_weights)
        out = self.dispatcher.combine(self.compute(batch, x.dtype), handle)
        if progress is not None:
            progress.in_collective = False
            progress.layers_done += 1
        return out

    def run_empty(self, hidden_size: int, dtype: torch.dtype, k: int) -> None:
        """This layer's collectives with no tokens (a rank with nothing to run this step)."""
        dev = self.gate_up_proj.device
        self.forward(torch.zeros(0, hidden_size, dtype=dtype, device=dev),
                     torch.zeros(0, k, dtype=torch.float32, device=dev),
                     torch.zeros(0, k, dtype=torch.long, device=dev))

    def compute(self, batch: ExpertBatch, dtype: torch.dtype) -> Tensor:
        """Rows of `batch` through their local slot's expert, grouped by slot -> [N, H]."""
        x = batch.hidden
        if x.shape[0] == 0:
            return x.new_zeros(0, x.shape[1])
        cpu_start = time.thread_time()
        order = batch.local_slots.argsort(stable=True)
        counts = torch.bincount(batch.local_slots, minlength=self.slots_per_rank).tolist()
        sorted_x = x.index_select(0, order)
        out = torch.empty_like(sorted_x)
        start = 0
        for slot, count in enumerate(counts):
            if count == 0:
                continue
            end = start + count
            gate_up = self._slot_linear(sorted_x[start:end], 0, slot)  # [n, 2I]
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            out[start:end] = self._slot_linear(F.silu(gate) * up, 1, slot)  # [n, hidden]
            start = end
        y = torch.empty_like(out).index_copy_(0, order, out)  # back to batch order
        if batch.weights is not None:
            y = (y * batch.weights.unsqueeze(1)).to(dtype)
        self.compute_cpu_s += time.thread_time() - cpu_start  # CPU only: CUDA work is async
        return y
