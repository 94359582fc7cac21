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
    num_ranks = old.shape[1] // slots_per_rank
    per_node = ranks_per_node or num_ranks
    out = np.empty_like(new)
    for layer in range(old.shape[0]):
        old_sets = old[layer].reshape(num_ranks, slots_per_rank)
        new_sets = new[layer].reshape(num_ranks, slots_per_rank)
        for node_start in range(0, num_ranks, per_node):
            ranks = range(node_start, node_start + per_node)
            for old_rank, new_rank in _match_ranks(old_sets, new_sets, ranks):
                out[layer, old_rank * slots_per_rank:(old_rank + 1) * slots_per_rank] = \
                    _keep_slots(old_sets[old_rank], new_sets[new_rank])
    return out


def _match_ranks(old_sets: np.ndarray, new_sets: np.ndarray, ranks: range) -> list[tuple[int, int]]:
    """Greedy max-overlap pairing of old ranks with the plan's ranks (both within `ranks`)."""
    overlap = {(a, b): _multiset_overlap(old_sets[a], new_sets[b]) for a in ranks for b in ranks}
    pairs, used_old, used_new = [], set(), set()
    for (a, b), _ in sorted(overlap.items(), key=lambda item: (-item[1], item[0])):
        if a not in used_old and b not in used_new:
            pairs.append((a, b))
            used_old.add(a)
            used_new.add(b)
    return pairs


def _multiset_overlap(a: np.ndarray, b: np.ndarray) -> int:
    values, counts_a = np.unique(a, return_counts=True)
    counts_b = np.array([np.count_nonzero(b == v) for v in values])
    return int(np.minimum(counts_a, counts_b).sum())


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
