"""plan_expert_moves: applying the moves to the old layout gives the new one, only changed
slots are touched, and the cheapest source is used (own rank, then one transfer per rank)."""
from __future__ import annotations

import numpy as np
import pytest

from deepinfer.moe.eplb import plan_placement
from deepinfer.moe.expert_moves import plan_expert_moves


def apply(old: np.ndarray, moves, slots_per_rank: int) -> np.ndarray:
    """Two phases, as the rebalancer: local/remote read the OLD layout, copies the new one."""
    new = old.copy()
    for m in moves:
        if m.kind in ("local", "remote"):
            new[m.layer, m.slot] = old[m.layer, m.source_slot]
    for m in moves:
        if m.kind == "copy":
            new[m.layer, m.slot] = new[m.layer, m.source_slot]
    return new


def random_layouts(seed: int, num_experts=8, num_ranks=4, num_redundant=4, num_layers=3):
    rng = np.random.default_rng(seed)
    slots = num_experts + num_redundant
    old_loads = rng.zipf(1.5, (num_layers, num_experts)).astype(float)
    new_loads = rng.zipf(1.5, (num_layers, num_experts)).astype(float)
    old = plan_placement(old_loads, slots, num_ranks).phy2log
    new = plan_placement(new_loads, slots, num_ranks).phy2log
    return old, new, slots // num_ranks


@pytest.mark.parametrize("seed", range(20))
def test_moves_rebuild_the_new_layout_from_the_cheapest_sources(seed):
    old, new, per_rank = random_layouts(seed)
    moves = plan_expert_moves(old, new, per_rank)
    assert np.array_equal(apply(old, moves, per_rank), new)
    changed = {(int(l), int(s)) for l, s in zip(*np.nonzero(old != new))}
    assert {(m.layer, m.slot) for m in moves} == changed  # exactly the changed slots
    received = set()
    for m in moves:
        rank = m.slot // per_rank
        own = old[m.layer, rank * per_rank:(rank + 1) * per_rank]
        if m.kind == "local":
            assert m.source_slot // per_rank == rank and old[m.layer, m.source_slot] == m.expert
        elif m.kind == "remote":
            assert m.expert not in own, "sent over the wire although the rank held it"
            assert m.source_slot // per_rank != rank and old[m.layer, m.source_slot] == m.expert
            assert (m.layer, rank, m.expert) not in received, "one expert received twice by a rank"
            received.add((m.layer, rank, m.expert))
        else:
            assert m.kind == "copy" and (m.layer, rank, m.expert) in received


def test_same_layout_moves_nothing_and_shape_mismatch_is_an_error():
    old, _, per_rank = random_layouts(0)
    assert plan_expert_moves(old, old, per_rank) == []
    with pytest.raises(ValueError):
        plan_expert_moves(old, old[:, :-1], per_rank)


def test_replicas_take_turns_as_sources():
    # Expert 0 held on ranks 0 and 1; ranks 2 and 3 each get a replica: two different senders.
    old = np.array([[0, 1, 0, 2, 3, 4, 5, 6]])
    new = np.array([[0, 1, 0, 2, 0, 4, 0, 6]])  # slots 4 and 6 (ranks 2, 3) become expert 0
    moves = plan_expert_moves(old, new, 2)
    assert sorted(m.source_slot for m in moves) == [0, 2]


def test_moves_recorder_and_eplb_config_are_pure():
    """Like moe/eplb.py they import nothing heavy (the simulator may drive them)."""
    from tests.unit.test_pure_imports import run_child
    report = run_child(["deepinfer.moe.expert_moves", "deepinfer.moe.load_recorder",
                        "deepinfer.moe.eplb_config"])
    assert report["errors"] == {} and report["attempts"] == [], report


@pytest.mark.parametrize("seed", range(10))
def test_alignment_keeps_balancedness_and_changes_fewer_slots(seed):
    from deepinfer.moe.eplb import placement_from_phy2log
    from deepinfer.moe.expert_moves import align_to_current

    old, new, per_rank = random_layouts(seed)
    aligned = align_to_current(old, new, per_rank)
    loads = np.random.default_rng(seed).zipf(1.5, (old.shape[0], 8)).astype(float)
    planned, kept = placement_from_phy2log(new, 8, 4), placement_from_phy2log(aligned, 8, 4)
    np.testing.assert_allclose(np.sort(planned.rank_loads(loads), -1),
                               np.sort(kept.rank_loads(loads), -1))  # same loads, other ranks
    assert np.count_nonzero(aligned != old) <= np.count_nonzero(new != old)
    # A plan that only relabels the current layout (ranks rotated, slots reversed) moves nothing.
    relabelled = np.roll(old.reshape(old.shape[0], 4, per_rank)[:, :, ::-1], 1, axis=1).reshape(old.shape)
    assert np.array_equal(align_to_current(old, relabelled, per_rank), old)


def test_alignment_stays_within_nodes():
    from deepinfer.moe.expert_moves import align_to_current
    old = np.array([[0, 1, 2, 3, 4, 5, 6, 7]])  # 4 ranks x 2 slots, nodes {0,1} and {2,3}
    new = np.array([[4, 5, 6, 7, 0, 1, 2, 3]])  # node contents swapped: may not cross nodes
    aligned = align_to_current(old, new, 2, ranks_per_node=2)
    assert set(aligned[0, :4]) == {4, 5, 6, 7} and set(aligned[0, 4:]) == {0, 1, 2, 3}
