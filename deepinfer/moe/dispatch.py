"""Token dispatch and combine for expert-parallel MoE layers: one interface, three transports.

Each rank holds `slots_per_rank` physical expert slots, rank-major (slot p lives on rank
p // slots_per_rank). A rank's tokens pick physical slots; `dispatch` brings every
(token, slot) pair to the rank that holds the slot, that rank's experts compute them, and
`combine` brings the results back as the weighted sum per token:

    rank r: x [T_r, H], slots [T_r, k], weights [T_r, k]
        ── dispatch ──▶ ExpertBatch(hidden [N, H], local_slots [N], weights [N] | None)
        ── local experts ──▶ y [N, H]
        ── combine ──▶ out [T_r, H] = sum_k weight_k * expert_k(x)

- `AllGatherDispatcher` (reference): every rank gathers every rank's tokens, computes the pairs
  that hit its own slots (weighted), and a reduce-scatter sums the partial outputs back to the
  owners. Simple; moves every token to every rank.
- `AllToAllDispatcher`: counts first (one all_to_all of [ranks] ints), then the payload: each
  pair's row goes only to its slot's rank and comes back unweighted; the owner of the token
  applies the weights and sums in a fixed order. A rank's results never mix with other ranks'
  tokens, so they do not depend on what else is in the step.
- `LocalDispatcher`: one rank, no communication (tests, and EP=1).

Every rank calls dispatch/combine once per MoE layer per step, with T_r = 0 when it has no
tokens: the collectives must match across the group.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass
class ExpertBatch:
    """The pairs this rank's experts must compute."""

    hidden: Tensor  # [N, H]
    local_slots: Tensor  # [N] long, slot index on this rank (0 .. slots_per_rank - 1)
    weights: Tensor | None  # [N] float32 to apply on the expert side, or None (applied in combine)


class TokenDispatcher(ABC):
    def __init__(self, rank: int, world_size: int, slots_per_rank: int, group=None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.slots_per_rank = slots_per_rank
        self.group = group

    @abstractmethod
    def dispatch(self, hidden: Tensor, slot_ids: Tensor, weights: Tensor) -> tuple[ExpertBatch, object]:
        """hidden [T, H], slot_ids [T, k] physical slots, weights [T, k] -> (batch, handle)."""

    @abstractmethod
    def combine(self, expert_out: Tensor, handle: object) -> Tensor:
        """expert_out [N, H] (rows of the batch, in its order) -> out [T, H] of this rank."""


def weighted_sum(pair_out: Tensor, pair_weights: Tensor, token_idx: Tensor, num_tokens: int,
                 dtype: torch.dtype) -> Tensor:
    """out[t] = sum over t's pairs of weight * pair_out (weights in fp32, as MoEExperts)."""
    out = torch.zeros(num_tokens, pair_out.shape[1], dtype=dtype, device=pair_out.device)
    if pair_out.shape[0]:
        out.index_add_(0, token_idx, (pair_out * pair_weights.unsqueeze(1)).to(dtype))
    return out


class LocalDispatcher(TokenDispatcher):
    """Every slot is local: the batch is the pairs themselves."""

    def __init__(self, slots_per_rank: int) -> None:
        super().__init__(0, 1, slots_per_rank)

    def dispatch(self, hidden, slot_ids, weights):
        k = slot_ids.shape[1]
        token_idx = torch.arange(slot_ids.numel(), device=hidden.device) // k
        batch = ExpertBatch(hidden.index_select(0, token_idx), slot_ids.reshape(-1), None)
        return batch, (token_idx, weights.reshape(-1), hidden.shape[0], hidden.dtype)

    def combine(self, expert_out, handle):
        token_idx, pair_weights, num_tokens, dtype = handle
        return weighted_sum(expert_out, pair_weights, token_idx, num_tokens, dtype)


class AllGatherDispatcher(TokenDispatcher):
    """Reference: all-gather every rank's tokens, reduce-scatter the partial sums."""

    def dispatch(self, hidden, slot_ids, weights):
        dev, (num_tokens, k) = hidden.device, slot_ids.shape
        counts = torch.empty(self.world_size, dtype=torch.long, device=dev)
        _all_gather(counts, torch.tensor([num_tokens], device=dev), group=self.group)
        max_tokens = int(counts.max())
        if max_tokens == 0:  # every rank is empty: same decision everywhere
            return ExpertBatch(hidden[:0], slot_ids.reshape(-1)[:0], None), None
        pad = max_tokens - num_tokens
        padded_x = torch.cat([hidden, hidden.new_zeros(pad, hidden.shape[1])])
        padded_slots = torch.cat([slot_ids, slot_ids.new_full((pad, k), -1)])  # -1: on no rank
        padded_w = torch.cat([weights, weights.new_zeros(pad, k)])
        all_x = self._gather(padded_x)  # [R * Tmax, H]
        all_slots = self._gather(padded_slots)  # [R * Tmax, k]
        all_w = self._gather(padded_w)
        first = self.rank * self.slots_per_rank
        mine = (all_slots >= first) & (all_slots < first + self.slots_per_rank)
        token_idx, j = mine.nonzero(as_tuple=True)
        batch = ExpertBatch(all_x.index_select(0, token_idx), all_slots[token_idx, j] - first,
                            all_w[token_idx, j])
        return batch, (token_idx, max_tokens, num_tokens)

    def combine(self, expert_out, handle):
        if handle is None:
            return expert_out.new_zeros(0, expert_out.shape[1])
        token_idx, max_tokens, num_tokens = handle
        partial = expert_out.new_zeros(self.world_size * max_tokens, expert_out.shape[1])
        partial.index_add_(0, token_idx, expert_out)  # [R * Tmax, H]: my slots' share
        out = expert_out.new_empty(max_tokens, expert_out.shape[1])
        _reduce_scatter(out, partial, group=self.group)
        return out[:num_tokens]

    def _gather(self, t: Tensor) -> Tensor:
        out = t.new_empty(self.world_size * t.shape[0], *t.shape[1:])
        _all_gather(out, t.contiguous(), group=self.group)
        return out


# torch >= 2.13 renamed the tensor forms (the old names warn); either works on gloo and NCCL.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class AllToAllDispatcher(TokenDispatcher):
    """Counts, then payload: each pair travels only to its slot's rank and back."""

    def dispatch(self, hidden, slot_ids, weights):
        dev, k = hidden.device, slot_ids.shape[1]
        flat = slot_ids.reshape(-1)  # [T*k]
        dest = torch.div(flat, self.slots_per_rank, rounding_mode="floor")
        order = dest.argsort(stable=True)  # pairs grouped by destination rank
        token_idx = order // k
        send_counts = torch.bincount(dest, minlength=self.world_size)  # [R]
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
        local = flat.index_select(0, order) - dest.index_select(0, order) * self.slots_per_rank
        recv_x = hidden.new_empty(sum(recv_splits), hidden.shape[1])
        dist.all_to_all_single(recv_x, hidden.index_select(0, token_idx).contiguous(),
                               recv_splits, send_splits, group=self.group)
        recv_slots = local.new_empty(sum(recv_splits))
        dist.all_to_all_single(recv_slots, local.contiguous(), recv_splits, send_splits,
                               group=self.group)
        pair_weights = weights.reshape(-1).index_select(0, order)
        handle = (token_idx, pair_weights, send_splits, recv_splits, hidden.shape[0], hidden.dtype)
        return ExpertBatch(recv_x, recv_slots, None), handle

    def combine(self, expert_out, handle):
        token_idx, pair_weights, send_splits, recv_splits, num_tokens, dtype = handle
        back = expert_out.new_empty(sum(send_splits), expert_out.shape[1])  # [T*k, H] send order
        dist.all_to_all_single(back, expert_out.contiguous(), send_splits, recv_splits,
                               group=self.group)
        return weighted_sum(back, pair_weights, token_idx, num_tokens, dtype)


# Names as vLLM's --all2all-backend where one exists.
DISPATCHERS = {"alltoall": AllToAllDispatcher, "allgather_reducescatter": AllGatherDispatcher}


def make_dispatcher(kind: str, rank: int, world_size: int, slots_per_rank: int,
                    group=None) -> TokenDispatcher:
    if world_size == 1 and group is None and not dist.is_initialized():
        return LocalDispatcher(slots_per_rank)
    if kind not in DISPATCHERS:
        raise ValueError(f"dispatcher must be one of {sorted(DISPATCHERS)}, got {kind!r}")
    return DISPATCHERS[kind](rank, world_size, slots_per_rank, group)
