"""align_to_current (vectorized rank matching) returns exactly what the original per-pair
implementation returned (kept once, in benchmarks/eplb_align_bench.py) on random EPLB plans of
many shapes."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from deepinfer.moe.eplb import plan_placement
from deepinfer.moe.expert_moves import align_to_current


def _load_reference():
    """The implementation before vectorization, kept once, in the benchmark that times it."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "eplb_align_bench.py"
    spec = importlib.util.spec_from_file_location("eplb_align_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.old_align_to_current


reference_align = _load_reference()


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
