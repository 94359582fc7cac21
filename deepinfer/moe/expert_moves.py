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
    kind: str  # "local" (old slot, same rank) | "remote" (old slot, other rank) | "copy" (new slot, same rank, after the transfers)


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
