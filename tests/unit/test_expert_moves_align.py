"""align_to_current (vectorized rank matching) returns exactly what the original per-pair
implementation returned, kept below as the reference, on random EPLB plans of many shapes."""
from __future__ import annotations

import numpy as np
import pytest

from deepinfer.moe.eplb import plan_placement
from deepinfer.moe.expert_moves import align_to_current


def reference_align(old, new, slots_per_rank, ranks_per_node=None):
    """The implementation before vectorization (np.unique per rank pair, Python sort)."""
    old, new = np.asarray(old, dtype=np.int64), np.asarray(new, dtype=np.int64)
    num_ranks = old.shape[1] // slots_per_rank
    per_node = ranks_per_node or num_ranks
    out = np.empty_like(new)
    for layer in range(old.shape[0]):
        old_sets = old[layer].reshape(num_ranks, slots_per_rank)
        new_sets = new[layer].reshape(num_ranks, slots_per_rank)
        for start in range(0, num_ranks, per_node):
            ranks = range(start, start + per_node)
            overlap = {(a, b): reference_overlap(old_sets[a], new_sets[b])
                       for a in ranks for b in ranks}
            used_old, used_new = set(), set()
            for (a, b), _ in sorted(overlap.items(), key=lambda item: (-item[1], item[0])):
                if a not in used_old and b not in used_new:
                    used_old.add(a)
                    used_new.add(b)
                    out[layer, a * slots_per_rank:(a + 1) * slots_per_rank] = \
                        reference_keep(old_sets[a], new_sets[b])
    return out


def reference_overlap(a, b):
    values, counts_a = np.unique(a, return_counts=True)
    return int(np.minimum(counts_a, [np.count_nonzero(b == v) for v in values]).sum())


def reference_keep(old_slots, new_experts):
    remaining = list(new_experts)
    out = np.full(old_slots.shape[0], -1, dtype=np.int64)
    for i, expert in enumerate(old_slots):
        if expert in remaining:
            out[i] = expert
            remaining.remove(expert)
    out[out < 0] = remaining
    return out


# (ranks, slots per rank, logical experts, nodes): redundant replicas everywhere (slots > experts,
# so a rank may hold an expert twice); nodes > 1 exercises ranks_per_node.
SHAPES = [(4, 2, 6, 1), (4, 3, 8, 2), (8, 9, 16, 1), (8, 4, 24, 2), (16, 3, 32, 4),
          (32, 9, 256, 4), (64, 2, 96, 1), (64, 5, 256, 8), (6, 7, 9, 3), (12, 2, 20, 3)]


@pytest.mark.parametrize("ranks,per_rank,experts,nodes", SHAPES)
def test_matches_the_reference_on_random_plans(ranks, per_rank, experts, nodes):
    rng = np.random.default_rng(ranks * 1000 + per_rank * 10 + nodes)
    layers, slots = 3, ranks * per_rank
    groups = nodes if experts % nodes == 0 else 1
    old_loads, new_loads = rng.zipf(1.3, (2, layers, experts)).astype(float)
    old = plan_placement(old_loads, slots, ranks, groups, nodes).phy2log
    new = plan_placement(new_loads, slots, ranks, groups, nodes).phy2log
    # Also a shuffled plan (any rank may hold anything, repeats included): many overlap ties.
    shuffled = rng.permuted(np.concatenate([old[:, :experts], rng.integers(
        0, experts, (layers, slots - experts))], axis=1), axis=1)
    per_node = ranks // nodes if nodes > 1 else None
    for plan in (new, shuffled, old):
        expected = reference_align(old, plan, per_rank, per_node)
        assert np.array_equal(align_to_current(old, plan, per_rank, per_node), expected)


def test_ties_pair_the_lowest_old_rank_with_the_lowest_new_rank():
    # Every old rank shares one expert with every new rank: the tie-break alone decides.
    old = np.array([[0, 1, 0, 1, 0, 1]])
    new = np.array([[1, 2, 0, 3, 1, 4]])
    assert align_to_current(old, new, 2).tolist() == [[2, 1, 0, 3, 4, 1]]
    # Ranks sharing nothing are paired in rank order after the overlapping ones.
    old = np.array([[0, 1, 2, 3, 4, 5]])
    new = np.array([[6, 7, 8, 9, 0, 5]])  # only new rank 2 overlaps (with old rank 0)
    assert align_to_current(old, new, 2).tolist() == [[0, 5, 6, 7, 8, 9]]


def test_bad_shapes_are_errors():
    old = np.zeros((2, 8), dtype=np.int64)
    with pytest.raises(ValueError):
        align_to_current(old, old[:, :6], 2)
    with pytest.raises(ValueError):
        align_to_current(old, old, 3)  # 8 slots are not ranks of 3
    with pytest.raises(ValueError):
        align_to_current(old, old, 2, ranks_per_node=3)  # 4 ranks are not nodes of 3
