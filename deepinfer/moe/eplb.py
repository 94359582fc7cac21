"""Expert-parallel load balancer (EPLB) planner. PURE: numpy only, no torch.

Given each MoE layer's recorded load per logical expert, choose how many replicas every expert
gets and which rank holds each replica, so that the busiest rank of a layer waits as little as
possible. Physical slots are numbered rank-major:

    slot id = rank * slots_per_rank + position          (rank r holds slots [r*S, (r+1)*S))

    phy2log[layer, slot]           logical expert held by that slot
    logcnt[layer, expert]          its number of replicas (>= 1)
    log2phy[layer, expert, j]      its j-th replica's slot, j < logcnt; entries past logcnt
                                   repeat the replicas cyclically (always a valid slot id)

Three steps, each greedy then locally improved:
1. replicate: every extra slot goes to the expert with the highest load per replica;
2. pack: replicas (load / count each) go heaviest first onto the least-loaded rank with room;
3. refine: swap replicas between the busiest rank and any other while that lowers the pair's
   maximum, so the result is never worse than the greedy packing it starts from.
The plan is also never worse than placing each expert once (the no-replica packing is a
candidate too, its spare slots repeating experts on their own rank).
Hierarchical mode (expert groups divisible by nodes): groups are packed onto nodes first, so a
group's experts and all their replicas stay inside one node (token dispatch of a group is
intra-node), then steps 1-3 run per node over that node's ranks.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ExpertPlacement:
    phy2log: np.ndarray  # [layers, num_physical] int64
    log2phy: np.ndarray  # [layers, num_logical, max_replicas] int64
    logcnt: np.ndarray  # [layers, num_logical] int64
    num_ranks: int

    @property
    def num_layers(self) -> int:
        return self.phy2log.shape[0]

    @property
    def num_physical_experts(self) -> int:
        return self.phy2log.shape[1]

    @property
    def slots_per_rank(self) -> int:
        return self.num_physical_experts // self.num_ranks

    def slot_loads(self, loads: np.ndarray) -> np.ndarray:
        """Load of every slot when each expert's tokens spread evenly over its replicas."""
        loads = np.asarray(loads, dtype=np.float64)  # [layers, num_logical]
        per_replica = loads / self.logcnt
        return np.take_along_axis(per_replica, self.phy2log, axis=1)  # [layers, num_physical]

    def rank_loads(self, loads: np.ndarray) -> np.ndarray:
        slot = self.slot_loads(loads)
        return slot.reshape(self.num_layers, self.num_ranks, self.slots_per_rank).sum(-1)

    def balancedness(self, loads: np.ndarray) -> np.ndarray:
        """Per layer: mean rank load / max rank load (1.0 = perfect; layers with no load: 1)."""
        return balancedness(self.rank_loads(loads))


def balancedness(rank_loads: np.ndarray) -> np.ndarray:
    rank_loads = np.asarray(rank_loads, dtype=np.float64)  # [layers, ranks]
    peak = rank_loads.max(-1)
    mean = rank_loads.mean(-1)
    return np.where(peak > 0, mean / np.where(peak > 0, peak, 1.0), 1.0)


def plan_placement(loads, num_physical_experts: int, num_ranks: int, num_groups: int = 1,
                   num_nodes: int = 1) -> ExpertPlacement:
    """Plan replicas and their ranks from `loads` [layers, num_logical] (tokens per expert).

    Hierarchical when `num_groups % num_nodes == 0` and there is more than one node; global
    (one node holding every rank) otherwise.
    """
    loads = np.asarray(loads, dtype=np.float64)
    if loads.ndim != 2:
        raise ValueError(f"loads must be [layers, experts], got shape {loads.shape}")
    if not np.all(np.isfinite(loads)) or np.any(loads < 0):
        raise ValueError("loads must be finite and non-negative")
    num_layers, num_logical = loads.shape
    if num_ranks < 1 or num_physical_experts % num_ranks:
        raise ValueError(f"{num_physical_experts} physical experts do not divide over "
                         f"{num_ranks} ranks")
    if num_physical_experts < num_logical:
        raise ValueError(f"{num_physical_experts} physical slots < {num_logical} experts")
    if num_groups < 1 or num_logical % num_groups:
        raise ValueError(f"{num_logical} experts do not split into {num_groups} groups")
    if num_nodes < 1 or num_ranks % num_nodes:
        raise ValueError(f"{num_ranks} ranks do not split over {num_nodes} nodes")
    if num_nodes == 1 or num_groups % num_nodes:
        num_groups, num_nodes = 1, 1  # global policy
    phy2log = np.stack([_plan_layer(loads[layer], num_physical_experts, num_ranks, num_groups,
                                    num_nodes) for layer in range(num_layers)])
    logcnt = np.stack([np.bincount(row, minlength=num_logical) for row in phy2log])
    return ExpertPlacement(phy2log, _log2phy(phy2log, logcnt), logcnt, num_ranks)


def _plan_layer(load: np.ndarray, num_physical: int, num_ranks: int, num_groups: int,
                num_nodes: int) -> np.ndarray:
    """phy2log of one layer."""
    num_logical = load.shape[0]
    group_size = num_logical // num_groups
    if num_physical // num_nodes < (num_groups // num_nodes) * group_size:
        raise ValueError("too few physical slots per node for its expert groups")
    group_loads = load.reshape(num_groups, group_size).sum(-1)
    if num_nodes == 1:
        return _plan_nodes(load, np.zeros(num_groups, dtype=np.int64), num_physical, num_ranks,
                           group_size, 1)
    # A better-balanced group packing does not always give better-balanced ranks: plan from
    # the greedy and the refined packing and keep the lower peak (never worse than greedy).
    candidates = [_plan_nodes(load, pack_items(group_loads, num_nodes, refine=refine),
                              num_physical, num_ranks, group_size, num_nodes)
                  for refine in (False, True)]
    peaks = [_peak(load, c, num_ranks) for c in candidates]
    return candidates[int(np.argmin(peaks))]


def _plan_nodes(load: np.ndarray, group_node: np.ndarray, num_physical: int, num_ranks: int,
                group_size: int, num_nodes: int) -> np.ndarray:
    """Replicate and pack each node's experts onto its ranks; phy2log rank-major."""
    ranks_per_node = num_ranks // num_nodes
    slots_per_node = num_physical // num_nodes
    phy2log = np.empty(num_physical, dtype=np.int64)
    for node in range(num_nodes):
        experts = np.concatenate([np.arange(g * group_size, (g + 1) * group_size)
                                  for g in np.flatnonzero(group_node == node)])
        candidates = [_replicate_and_pack(load[experts], slots_per_node, ranks_per_node)]
        if len(experts) % ranks_per_node == 0:
            candidates.append(_pack_without_replicas(load[experts], slots_per_node,
                                                     ranks_per_node))
        local = min(candidates, key=lambda c: _peak(load[experts], c, ranks_per_node))
        phy2log[node * slots_per_node:(node + 1) * slots_per_node] = experts[local]
    return phy2log


def _replicate_and_pack(load: np.ndarray, num_slots: int, num_ranks: int) -> np.ndarray:
    local = replicate(load, num_slots)  # replica -> expert
    replica_loads = load[local] / np.bincount(local)[local]
    rank_of = pack_items(replica_loads, num_ranks)
    return local[np.argsort(rank_of, kind="stable")]  # rank-major slots


def _pack_without_replicas(load: np.ndarray, num_slots: int, num_ranks: int) -> np.ndarray:
    """Every expert once; a rank's spare slots repeat its own heaviest experts, which leaves
    every rank's load as without replicas. Guarantees redundancy never balances worse."""
    rank_of = pack_items(load, num_ranks)
    slots_per_rank = num_slots // num_ranks
    layout = []
    for rank in range(num_ranks):
        own = np.flatnonzero(rank_of == rank)
        own = own[np.argsort(-load[own], kind="stable")]
        layout.append(np.resize(own, slots_per_rank))  # cycles through its own experts
    return np.concatenate(layout)


def _peak(load: np.ndarray, slots: np.ndarray, num_ranks: int) -> float:
    per_slot = (load / np.bincount(slots, minlength=load.shape[0]))[slots]
    return float(per_slot.reshape(num_ranks, -1).sum(-1).max())


def replicate(load: np.ndarray, num_slots: int) -> np.ndarray:
    """Expert index of every replica: one each, then every extra slot to argmax load/count."""
    num_experts = load.shape[0]
    counts = np.ones(num_experts, dtype=np.int64)
    for _ in range(num_slots - num_experts):
        counts[int(np.argmax(load / counts))] += 1
    return np.repeat(np.arange(num_experts), counts)


def pack_items(weights: np.ndarray, num_packs: int, refine: bool = True) -> np.ndarray:
    """Pack index of every item; each pack gets exactly len(weights) / num_packs items.

    Greedy (heaviest first onto the lightest pack with room), then pairwise swaps that lower
    the heaviest pack; the result is never heavier at its peak than the greedy one.
    """
    num_items = weights.shape[0]
    if num_items % num_packs:
        raise ValueError(f"{num_items} items do not split into {num_packs} equal packs")
    capacity = num_items // num_packs
    pack_of = np.empty(num_items, dtype=np.int64)
    pack_load = np.zeros(num_packs)
    pack_size = np.zeros(num_packs, dtype=np.int64)
    for item in np.argsort(-weights, kind="stable"):
        open_packs = np.flatnonzero(pack_size < capacity)
        pack = open_packs[np.argmin(pack_load[open_packs])]
        pack_of[item] = pack
        pack_load[pack] += weights[item]
        pack_size[pack] += 1
    if refine and capacity > 1 and num_packs > 1:
        _refine_by_swaps(weights, pack_of, pack_load)
    return pack_of


def _refine_by_swaps(weights: np.ndarray, pack_of: np.ndarray, pack_load: np.ndarray,
                     max_rounds: int = 1000) -> None:
    """Swap one item of the heaviest pack with one item elsewhere while it lowers the peak.

    Every accepted swap strictly lowers max(load of the two packs) below the current peak, so
    the number of packs at the peak load, then the peak itself, decreases: it terminates.
    """
    eps = 1e-9 * max(float(weights.sum()), 1.0)
    for _ in range(max_rounds):
        heavy = int(np.argmax(pack_load))
        peak = pack_load[heavy]
        inside = np.flatnonzero(pack_of == heavy)
        outside = np.flatnonzero(pack_of != heavy)
        delta = weights[inside][:, None] - weights[outside][None, :]  # [in, out] moved off heavy
        new_heavy = peak - delta
        new_other = pack_load[pack_of[outside]][None, :] + delta
        worst = np.maximum(new_heavy, new_other)
        best = np.unravel_index(int(np.argmin(worst)), worst.shape)
        if worst[best] >= peak - eps:
            return
        a, b = inside[best[0]], outside[best[1]]
        other = pack_of[b]
        pack_load[heavy] -= delta[best]
        pack_load[other] += delta[best]
        pack_of[a], pack_of[b] = other, heavy


def _log2phy(phy2log: np.ndarray, logcnt: np.ndarray) -> np.ndarray:
    num_layers, num_logical = logcnt.shape
    max_replicas = int(logcnt.max())
    out = np.empty((num_layers, num_logical, max_replicas), dtype=np.int64)
    for layer in range(num_layers):
        slots = np.argsort(phy2log[layer], kind="stable")  # grouped by expert, slot order
        starts = np.concatenate([[0], np.cumsum(logcnt[layer])[:-1]])
        j = np.arange(max_replicas)
        out[layer] = slots[starts[:, None] + j[None, :] % logcnt[layer][:, None]]
    return out
