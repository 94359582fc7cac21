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
    if old.size == 0:
        return new.copy()
    # Expert ids renumbered 0..n-1 so they index count arrays (whatever ints they were).
    ids, dense = np.unique(np.stack([old, new]), return_inverse=True)
    dense = dense.reshape(2, old.shape[0], num_ranks, slots_per_rank)
    partner = np.empty((old.shape[0], num_ranks), dtype=np.int64)  # old rank -> plan's rank
    for layer in range(old.shape[0]):
        overlap = _overlaps(dense[0, layer], dense[1, layer], ids.size, per_node)
        for node, node_overlap in enumerate(overlap):
            start = node * per_node
            for a, b in _match_ranks(node_overlap):
                partner[layer, start + a] = start + b
    old_sets = old.reshape(-1, num_ranks, slots_per_rank)
    new_sets = np.take_along_axis(new.reshape(old_sets.shape), partner[:, :, None], axis=1)
    return _keep_slots(old_sets.reshape(-1, slots_per_rank),
                       new_sets.reshape(-1, slots_per_rank)).reshape(old.shape)


def _copy_index(sets: np.ndarray) -> np.ndarray:
    """[rows, slots]: 1 for a row's first slot holding its expert, 2 for the second..."""
    return np.tril(sets[:, :, None] == sets[:, None, :]).sum(-1)


def _overlaps(old_sets: np.ndarray, new_sets: np.ndarray, num_ids: int,
              per_node: int) -> np.ndarray:
    """[nodes, per_node, per_node]: how many experts (as multisets) each old rank of a node
    shares with each new rank of it, i.e. sum_e min(old count, new count).

    The j-th copy of expert e on an old rank counts once for every new rank holding e at least
    j times; summing over the old rank's slots gives sum_e min(...) without touching the
    experts neither holds (R x slots x per_node work, not R x E x R)."""
    num_ranks, per_rank = old_sets.shape
    num_nodes = num_ranks // per_node
    rank_ids = np.arange(num_ranks)
    new_counts = np.zeros((num_ranks, num_ids), dtype=np.int64)
    np.add.at(new_counts, (rank_ids[:, None], new_sets), 1)
    # [nodes, E, per_node]: per expert, its count on each new rank of the node.
    by_expert = new_counts.reshape(num_nodes, per_node, num_ids).transpose(0, 2, 1)
    held = by_expert[(rank_ids // per_node)[:, None], old_sets]  # [R, slots, per_node]
    return (held >= _copy_index(old_sets)[:, :, None]).sum(1).reshape(num_nodes, per_node, per_node)


def _match_ranks(overlap: np.ndarray) -> list[tuple[int, int]]:
    """Greedy max-overlap pairing of old ranks (rows) with the plan's ranks (columns): pairs
    taken in (-overlap, old rank, new rank) order while both are free."""
    n = overlap.shape[0]
    flat = overlap.ravel()
    shared = np.flatnonzero(flat > 0)  # at most n * slots_per_rank: the loop stays short
    order = shared[np.argsort(-flat[shared], kind="stable")]  # stable: ties by (old, new)
    used_old, used_new = [False] * n, [False] * n  # lists: cheaper to index than arrays
    pairs = []
    for index in order.tolist():
        a, b = divmod(index, n)
        if not (used_old[a] or used_new[b]):
            pairs.append((a, b))
            used_old[a] = used_new[b] = True
            if len(pairs) == n:
                return pairs
    # Every free-free pair left shares nothing, so the (old, new) order pairs them in turn.
    pairs += zip([a for a in range(n) if not used_old[a]], [b for b in range(n) if not used_new[b]])
    return pairs


def _keep_slots(old_slots: np.ndarray, new_experts: np.ndarray) -> np.ndarray:
    """[rows, slots]: each row's new experts arranged so that slots already holding one of them
    keep it. The j-th old slot of an expert keeps it when the new row holds it at least j times;
    the new row's other entries fill the remaining slots, both in slot order."""
    kept = ((old_slots[:, :, None] == new_experts[:, None, :]).sum(-1)
            >= _copy_index(old_slots))
    placed = ((new_experts[:, :, None] == old_slots[:, None, :]).sum(-1)
              >= _copy_index(new_experts))  # the first min(old, new count) copies stay put
    free_slots = np.argsort(kept, axis=1, kind="stable")  # slots not kept first, in order
    to_place = np.argsort(placed, axis=1, kind="stable")
    fill = np.arange(old_slots.shape[1]) < (~kept).sum(1, keepdims=True)
    rows = np.broadcast_to(np.arange(old_slots.shape[0])[:, None], fill.shape)
    out = np.where(kept, old_slots, -1)
    out[rows[fill], free_slots[fill]] = np.take_along_axis(new_experts, to_place, 1)[fill]
    return out
