"""Which expert weights must travel when the slot layout changes. PURE: numpy only.

Only slots whose logical expert changes are filled; each takes its expert from, in order:
1. a slot of the same rank that held it before (a local copy, nothing on the wire);
2. a slot of the same rank that receives it in this same move (one transfer per rank, then a copy);
3. a rank that held it before: the replicas take turns as sources, so a hot expert copied to
   many ranks is not sent by one rank alone.
Every rank computes the same list from the same two layouts, so the sends and receives match.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ExpertMove:
    layer: int
    slot: int  # destination slot (global id)
    expert: int  # logical expert it will hold
    source_slot: int  # global id: an old slot (kind local/remote) or a new slot (kind copy)
    # "local": old slot, same rank | "remote": old slot, other rank
    # "copy": new slot of the same rank, filled by a transfer of this same move
    kind: str


def plan_expert_moves(old_phy2log: np.ndarray, new_phy2log: np.ndarray,
                      slots_per_rank: int) -> list[ExpertMove]:
    old = np.asarray(old_phy2log, dtype=np.int64)
    new = np.asarray(new_phy2log, dtype=np.int64)
    if old.shape != new.shape or old.ndim != 2:
        raise ValueError(f"layouts differ in shape: {old.shape} vs {new.shape}")
    moves: list[ExpertMove] = []
    for layer in range(old.shape[0]):
        received: dict[tuple[int, int], int] = {}  # (rank, expert) -> new slot receiving it
        turn: dict[int, int] = {}  # expert -> next source replica index
        for slot in np.flatnonzero(old[layer] != new[layer]):
            slot, expert = int(slot), int(new[layer, slot])
            rank = slot // slots_per_rank
            mine = range(rank * slots_per_rank, (rank + 1) * slots_per_rank)
            own = [q for q in mine if old[layer, q] == expert]
            if own:
                moves.append(ExpertMove(layer, slot, expert, own[0], "local"))
            elif (rank, expert) in received:
                moves.append(ExpertMove(layer, slot, expert, received[(rank, expert)], "copy"))
            else:
                holders = np.flatnonzero(old[layer] == expert)
                if holders.size == 0:
                    raise ValueError(f"layer {layer}: expert {expert} has no slot in the old layout")
                i = turn.get(expert, 0)
                turn[expert] = i + 1
                moves.append(ExpertMove(layer, slot, expert, int(holders[i % holders.size]), "remote"))
                received[(rank, expert)] = slot
    return moves


def align_to_current(old_phy2log: np.ndarray, new_phy2log: np.ndarray, slots_per_rank: int,
                     ranks_per_node: int | None = None) -> np.ndarray:
    """`new_phy2log` relabelled to change as few slots as possible: which rank gets which of the
    plan's rank contents, and which slot of a rank holds which of its experts, do not change any
    rank's load, so the plan keeps its balancedness while most slots keep their weights.

    Ranks are matched greedily by the number of experts they share (within a node when
    `ranks_per_node` is given, so hierarchical plans keep their groups inside nodes); inside a
    rank, experts it already holds stay in their slots.
    """
    old = np.asarray(old_phy2log, dtype=np.int64)
    new = np.asarray(new_phy2log, dtype=np.int64)
    if old.shape != new.shape or old.ndim != 2:
        raise ValueError(f"layouts differ in shape: {old.shape} vs {new.shape}")
    if slots_per_rank < 1 or old.shape[1] % slots_per_rank:
        raise ValueError(f"{old.shape[1]} slots do not split into ranks of {slots_per_rank}")
    num_ranks = old.shape[1] // slots_per_rank
    per_node = ranks_per_node or num_ranks
    if per_node < 1 or num_ranks % per_node:
        raise ValueError(f"{num_ranks} ranks do not split into nodes of {per_node}")
    out = np.empty_like(new)
    if old.size == 0:
        return out
    # Expert ids renumbered 0..n-1 so they index count matrices (whatever ints they were).
    ids, dense = np.unique(np.stack([old, new]), return_inverse=True)
    dense = dense.reshape(2, *old.shape)
    for layer in range(old.shape[0]):
        old_sets = old[layer].reshape(num_ranks, slots_per_rank)
        new_sets = new[layer].reshape(num_ranks, slots_per_rank)
        overlap = _overlaps(_counts(dense[0, layer].reshape(num_ranks, -1), ids.size),
                            _counts(dense[1, layer].reshape(num_ranks, -1), ids.size), per_node)
        for node, node_overlap in enumerate(overlap):
            start = node * per_node
            for a, b in _match_ranks(node_overlap):
                old_rank, new_rank = start + a, start + b
                out[layer, old_rank * slots_per_rank:(old_rank + 1) * slots_per_rank] = \
                    _keep_slots(old_sets[old_rank], new_sets[new_rank])
    return out


def _counts(sets: np.ndarray, num_ids: int) -> np.ndarray:
    """[ranks, num_ids]: how many slots of each rank hold each expert."""
    num_ranks = sets.shape[0]
    flat = (np.arange(num_ranks)[:, None] * num_ids + sets).ravel()
    return np.bincount(flat, minlength=num_ranks * num_ids).reshape(num_ranks, num_ids)


def _overlaps(old_counts: np.ndarray, new_counts: np.ndarray, per_node: int) -> np.ndarray:
    """[nodes, per_node, per_node]: experts shared (as multisets) by each old and new rank of a
    node. sum_e min(a_e, b_e) = sum_k #{e: a_e >= k and b_e >= k}, i.e. one matmul per k."""
    num_nodes = old_counts.shape[0] // per_node
    old_counts = old_counts.reshape(num_nodes, per_node, -1)
    new_counts = new_counts.reshape(num_nodes, per_node, -1)
    total = np.zeros((num_nodes, per_node, per_node))
    # Float matmul (BLAS) is exact here: every sum is at most slots_per_rank.
    for k in range(1, int(min(old_counts.max(), new_counts.max())) + 1):
        total += (old_counts >= k).astype(np.float64) @ \
            (new_counts >= k).astype(np.float64).transpose(0, 2, 1)
    return total.astype(np.int64)


def _match_ranks(overlap: np.ndarray) -> list[tuple[int, int]]:
    """Greedy max-overlap pairing of old ranks (rows) with the plan's ranks (columns): pairs
    taken in (-overlap, old rank, new rank) order while both are free."""
    n = overlap.shape[0]
    flat = overlap.ravel()
    shared = np.flatnonzero(flat > 0)  # at most n * slots_per_rank: the loop stays short
    order = shared[np.argsort(-flat[shared], kind="stable")]  # stable: ties by (old, new)
    used_old, used_new = np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
    pairs = []
    for index in order.tolist():
        a, b = divmod(index, n)
        if not (used_old[a] or used_new[b]):
            pairs.append((a, b))
            used_old[a] = used_new[b] = True
            if len(pairs) == n:
                return pairs
    # Every free-free pair left shares nothing, so the (old, new) order pairs them in turn.
    pairs += zip(np.flatnonzero(~used_old).tolist(), np.flatnonzero(~used_new).tolist())
    return pairs


def _keep_slots(old_slots: np.ndarray, new_experts: np.ndarray) -> np.ndarray:
    """The rank's new experts arranged so that slots already holding one of them keep it."""
    remaining = list(new_experts)
    out = np.full(old_slots.shape[0], -1, dtype=np.int64)
    for i, expert in enumerate(old_slots):
        if expert in remaining:
            out[i] = expert
            remaining.remove(expert)
    out[out < 0] = remaining
    return out
