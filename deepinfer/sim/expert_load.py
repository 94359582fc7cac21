"""Expert load in the loop: where a step's routed tokens go, and the engine's EPLB planner
re-placing the experts, so the roofline can charge an EP step the time of its busiest rank. Pure.

The load model (stated as data, `cost: {expert_load: {...}}` in a cluster file):

    share of logical expert e in layer l  ∝  exp(x[l, e])
    x[l, ·] at the start   exponent · -log(rank)  over a seeded random permutation per layer
                           (Zipf, as benchmarks/eplb_bench.py biases its router: hot experts
                           do not sit on one rank by construction); uniform: all 0
    drift                  after every step each x[l, e] takes a Gaussian step of sigma
                           drift_per_minute · sqrt(step seconds / 60): a random walk in the
                           worker's busy time (the traffic mix changes with time, not with
                           the EPLB settings)
    a step's pairs         multinomial: round(group tokens · top_k) (token, expert) pairs per
                           layer, so small decode batches carry their sampling noise

EPLB (the engine's `--eplb-config` semantics, moe/eplb_config.py): the worker records each step's
pairs per logical expert in a window of the last `window_size` steps and every `step_interval`
steps calls the engine's own `moe.eplb.plan_placement` on it (global policy, as the engine's
rebalancer is built), relabels the plan with `moe.expert_moves.align_to_current` and keeps a
layer's old layout unless it gains >= 0.01 balancedness (the rebalancer's rule). The weights that
move (`moe.expert_moves.plan_expert_moves`, remote moves) cost their bytes over NVLink within a
node and the NIC across nodes, once, on the busiest receiving rank.

The step's imbalance factor is the mean over layers of max rank load / mean rank load (each
layer's all-to-all waits for its slowest rank), i.e. 1 / balancedness.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from deepinfer.moe.eplb import ExpertPlacement, balancedness, placement_from_phy2log, plan_placement
from deepinfer.moe.eplb_config import EPLBConfig
from deepinfer.moe.expert_moves import align_to_current, plan_expert_moves

DISTRIBUTIONS = ("zipf", "uniform")
INITIAL = ("identity", "planned")
MIN_BALANCEDNESS_GAIN = 0.01  # as moe.rebalancer (which imports torch): a layer must gain this


@dataclass(frozen=True)
class ExpertLoadSpec:
    distribution: str = "zipf"
    exponent: float = 0.8  # zipf: share of the r-th hottest expert ∝ r^-exponent
    drift_per_minute: float = 0.1  # sigma of each expert's log-share walk per busy minute
    seed: int = 0
    eplb: bool = True  # rebalance in the loop (False: the initial placement stays)
    window_size: int = EPLBConfig.window_size  # steps of load history the planner sees
    step_interval: int = EPLBConfig.step_interval  # rebalance every this many steps
    # identity: slot p holds expert p % E (the engine's start); planned: planned from the
    # expected loads at the start (a deployment that has been rebalancing for a while)
    initial: str = "identity"

    def __post_init__(self) -> None:
        if self.distribution not in DISTRIBUTIONS:
            raise ValueError(f"expert_load.distribution must be one of {DISTRIBUTIONS}")
        if self.initial not in INITIAL:
            raise ValueError(f"expert_load.initial must be one of {INITIAL}")
        if self.exponent < 0 or self.drift_per_minute < 0:
            raise ValueError("expert_load.exponent and drift_per_minute must be >= 0")
        EPLBConfig(window_size=self.window_size, step_interval=self.step_interval)  # same checks

    @classmethod
    def from_value(cls, value: Any) -> "ExpertLoadSpec | None":
        """From a cluster file's `expert_load` mapping (None stays None)."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"expert_load must be a mapping, got {type(value).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(value) - known
        if unknown:
            raise ValueError(f"expert_load: unknown keys {sorted(unknown)}; allowed: {sorted(known)}")
        return cls(**value)


@dataclass(frozen=True)
class EPShape:
    """The EP group the placement spans, and what moving one expert costs."""

    num_layers: int  # MoE layers
    num_experts: int  # logical, per layer
    top_k: int
    num_physical: int  # experts + redundant, per layer
    num_ranks: int  # ep_size
    ranks_per_node: int
    expert_bytes: float  # one expert of one layer
    nvlink_bytes_per_s: float  # achieved, per GPU
    network_bytes_per_s: float  # achieved, per GPU


def identity_placement(shape: EPShape) -> ExpertPlacement:
    """The engine's initial layout: slot p holds expert p % E."""
    phy2log = np.tile(np.arange(shape.num_physical) % shape.num_experts, (shape.num_layers, 1))
    return placement_from_phy2log(phy2log, shape.num_experts, shape.num_ranks)


def imbalance(placement: ExpertPlacement, loads: np.ndarray) -> float:
    """Mean over layers of max / mean rank load (1.0: every rank equally loaded)."""
    return float(np.mean(1.0 / balancedness(placement.rank_loads(loads))))


def initial_log_shares(spec: ExpertLoadSpec, num_layers: int, num_experts: int) -> np.ndarray:
    """[layers, experts] log-shares at the start (the same for every worker of a seed)."""
    if spec.distribution == "uniform":
        return np.zeros((num_layers, num_experts))
    base = np.random.default_rng([spec.seed, 0])
    ranked = -spec.exponent * np.log(np.arange(1, num_experts + 1))
    return np.stack([ranked[base.permutation(num_experts)] for _ in range(num_layers)])


def shares_of(log_share: np.ndarray) -> np.ndarray:
    w = np.exp(log_share - log_share.max(-1, keepdims=True))
    return w / w.sum(-1, keepdims=True)


@functools.lru_cache(maxsize=16)
def _initial_placement(spec: ExpertLoadSpec, shape: EPShape) -> ExpertPlacement:
    """Shared by a pool's workers (read-only: a rebalance replaces it, never edits it)."""
    if spec.initial == "identity":
        return identity_placement(shape)
    expected = shares_of(initial_log_shares(spec, shape.num_layers, shape.num_experts))
    return plan_placement(expected * 1e6, shape.num_physical, shape.num_ranks)


class ExpertLoadTracker:
    """One EP worker's expert loads, window and placement: `step()` once per simulated step,
    then `drift(its seconds)`."""

    def __init__(self, spec: ExpertLoadSpec, shape: EPShape, worker_index: int = 0) -> None:
        if shape.num_physical % shape.num_ranks:
            raise ValueError(f"{shape.num_physical} physical experts do not divide over "
                             f"{shape.num_ranks} EP ranks")
        self.spec, self.shape = spec, shape
        layers, experts = shape.num_layers, shape.num_experts
        self.rng = np.random.default_rng([spec.seed, 1 + worker_index])  # drift and sampling
        self.log_share = initial_log_shares(spec, layers, experts)
        self.placement = _initial_placement(spec, shape)
        # The planner's input, as moe.load_recorder's logical window (ring of the last steps;
        # np.zeros pages in only the rows a run writes).
        self._window = np.zeros((spec.window_size, layers, experts), dtype=np.int32)
        self.num_steps = 0
        self.num_rebalances = 0
        self.moved_bytes = 0.0
        self.rebalance_s = 0.0
        self._imbalance_sum = 0.0
        self._balancedness_sum = 0.0
        self._weighted_pairs = 0.0  # pairs-weighted sums: big steps dominate the time
        self._weighted_imbalance = 0.0

    def shares(self) -> np.ndarray:
        """[layers, experts] expected share of each layer's pairs now."""
        return shares_of(self.log_share)

    def step(self, group_tokens: float) -> tuple[float, float]:
        """(imbalance factor of this step, seconds of expert moves this step triggers)."""
        pairs = int(round(group_tokens * self.shape.top_k))
        counts = self.rng.multinomial(pairs, self.shares()) if pairs > 0 else \
            np.zeros(self.log_share.shape, dtype=np.int64)
        layer_b = balancedness(self.placement.rank_loads(counts)) if pairs > 0 else np.ones(1)
        factor = float(np.mean(1.0 / layer_b))
        self._window[self.num_steps % self.spec.window_size] = counts
        self.num_steps += 1
        self._imbalance_sum += factor
        self._balancedness_sum += float(np.mean(layer_b))
        self._weighted_pairs += pairs
        self._weighted_imbalance += pairs * factor
        moves_s = 0.0
        if self.spec.eplb and self.num_steps % self.spec.step_interval == 0:
            moves_s = self.rebalance()
        return factor, moves_s

    def drift(self, seconds: float) -> None:
        """The loads move on by `seconds` of this worker's busy time."""
        sigma = self.spec.drift_per_minute * np.sqrt(max(0.0, seconds) / 60.0)
        if sigma > 0:
            self.log_share += self.rng.normal(0.0, sigma, self.log_share.shape)

    def rebalance(self) -> float:
        """Plan from the window with the engine's planner; seconds the weight moves take."""
        s = self.shape
        loads = self._window[:min(self.num_steps, self.spec.window_size)].sum(0, dtype=np.int64)
        planned = plan_placement(loads, s.num_physical, s.num_ranks)
        per_rank = s.num_physical // s.num_ranks
        aligned = align_to_current(self.placement.phy2log, planned.phy2log, per_rank, s.num_ranks)
        new = placement_from_phy2log(aligned, s.num_experts, s.num_ranks)
        keep = new.balancedness(loads) - self.placement.balancedness(loads) < MIN_BALANCEDNESS_GAIN
        aligned[keep] = self.placement.phy2log[keep]
        moves = plan_expert_moves(self.placement.phy2log, aligned, per_rank)
        self.placement = placement_from_phy2log(aligned, s.num_experts, s.num_ranks)
        nvlink = np.zeros(s.num_ranks)
        nic = np.zeros(s.num_ranks)
        for move in moves:
            if move.kind != "remote":
                continue
            dst, src = move.slot // per_rank, move.source_slot // per_rank
            same_node = dst // s.ranks_per_node == src // s.ranks_per_node
            (nvlink if same_node else nic)[dst] += s.expert_bytes
        seconds = float(np.max(np.maximum(nvlink / s.nvlink_bytes_per_s,
                                          nic / s.network_bytes_per_s)))
        self.num_rebalances += 1
        self.moved_bytes += float(nvlink.sum() + nic.sum())
        self.rebalance_s += seconds
        return seconds

    def stats(self) -> dict[str, float]:
        n = max(1, self.num_steps)
        return {"num_steps": self.num_steps,
                "imbalance_mean": self._imbalance_sum / n,  # per step
                "balancedness_mean": self._balancedness_sum / n,
                # weighted by the step's routed pairs (what the step time feels)
                "imbalance_token_weighted": (self._weighted_imbalance / self._weighted_pairs
                                             if self._weighted_pairs else 1.0),
                "num_rebalances": self.num_rebalances, "moved_bytes": self.moved_bytes,
                "rebalance_s": self.rebalance_s}
