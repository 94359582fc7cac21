"""Expert-parallel load balancer (EPLB) planner. PURE: numpy only, no torch.

Given each MoE layer's recorded load per logical expert, choose how many replicas every expert
gets and which rank holds each replica, so that the busiest rank of a layer waits as little as
possible. Physical slots are numbered rank-major:

    slot id = rank * slots_per_rank + position          (rank r holds slots [r*S, (r+1)*S))

    phy2log[layer, slot]           logical expert held by that slot
    logcnt[layer, expert]          its number of replicas (>= 1)
    log2phy[layer, expert, j]      its j-th replica's slot, j < logcnt; entries past logcnt
                                   repeat the replicas cyclically (always a valid slot id)

Each layer (per node in hierarchical mode) is planned from several candidate layouts:
- replicate-then-pack: every extra slot goes to the expert with the highest load per replica,
  replicas go heaviest first onto the least-loaded rank with room (DeepSeek's greedy), then
  optionally refined by swaps that lower the busiest rank without putting two replicas of one
  expert on the same rank;
- pack-then-replicate: every expert once, then spare slots take replicas where they do not
  raise the peak, else repeat one of the rank's own experts (no load moves);
- pack-then-split: the tight once-each packing with hot experts split into replicas (all at
  once then swapped, or one at a time while the peak bound holds): whole hot experts are
  what swings the next window's peak.
The greedy layout and the once-each layout bound the allowed peak, so the plan is never worse
on its window's loads than the greedy planner or than no replicas; among the layouts within
that bound the one with the lowest mean peak under per-expert load drift wins (the same
NUM_DRIFT_SAMPLES draws for every layout), since a plan made from one window serves the next.
With several nodes each node's layout is then chosen again by the whole layer's drift peak.
Hierarchical mode (expert groups divisible by nodes): groups are packed onto nodes first, so a
group's experts and all their replicas stay inside one node (token dispatch of a group is
intra-node).
"""
from __future__ import annotations

import functools
import heapq
from dataclasses import dataclass

import numpy as np

# How a plan is judged beyond the window it was made from: per-expert multiplicative drift.
LOAD_DRIFT_SIGMA = 0.3
NUM_DRIFT_SAMPLES = 256


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
    # the greedy and the refined packing; the greedy one bounds the peak.
    greedy, refined = (_plan_nodes(load, pack_items(group_loads, num_nodes, refine=refine),
                                   num_physical, num_ranks, group_size, num_nodes)
                       for refine in (False, True))
    return _choose([greedy, refined], load, num_ranks, _peak(load, greedy, num_ranks))


def _plan_nodes(load: np.ndarray, group_node: np.ndarray, num_physical: int, num_ranks: int,
                group_size: int, num_nodes: int) -> np.ndarray:
    """Replicate and pack each node's experts onto its ranks; phy2log rank-major.

    Each node's layout is chosen among its candidates within the node's guarantees, first by
    the node's own expected peak under drift, then once more by the whole layer's (a node's
    choice matters only where it can hold the layer's busiest rank)."""
    ranks_per_node = num_ranks // num_nodes
    slots_per_node = num_physical // num_nodes
    nodes = []  # (experts, node load, candidates, greedy peak, no-replica peak)
    for node in range(num_nodes):
        experts = np.concatenate([np.arange(g * group_size, (g + 1) * group_size)
                                  for g in np.flatnonzero(group_node == node)])
        node_load = load[experts]
        nodes.append((experts, node_load,
                      *_node_candidates(node_load, slots_per_node, ranks_per_node)))
    # Only the layer's busiest rank counts: every node may use any layout within the layer's
    # bound (the greedy layer's peak and the no-replica layer's), not only within its own.
    bound = min(max(n[3] for n in nodes), max(n[4] for n in nodes))
    options = []  # per node: feasible layouts as global expert ids, best drift first
    for experts, node_load, candidates, _, _ in nodes:
        local = _feasible(candidates, node_load, ranks_per_node, bound)
        scores = [_drift_peak(node_load, c, ranks_per_node) for c in local]
        options.append([experts[local[i]] for i in np.argsort(scores, kind="stable")])
    chosen = [opts[0] for opts in options]
    if num_nodes > 1:
        for node, opts in enumerate(options):
            def layer_score(layout, node=node):
                trial = chosen[:node] + [layout] + chosen[node + 1:]
                return _drift_peak(load, np.concatenate(trial), num_ranks)
            chosen[node] = min(opts, key=layer_score)
    return np.concatenate(chosen)


def _node_candidates(load: np.ndarray, num_slots: int,
                     num_ranks: int) -> tuple[list[np.ndarray], float, float]:
    """Candidate layouts of one node, the greedy layout's peak (DeepSeek's greedy) and the
    peak without replicas (inf when experts do not split evenly over the ranks); a plan may
    be no worse than either."""
    greedy = _replicate_and_pack(load, num_slots, num_ranks, refine=False)
    candidates = [greedy, _replicate_and_pack(load, num_slots, num_ranks)]
    greedy_peak, no_replica_peak = _peak(load, greedy, num_ranks), float("inf")
    if load.shape[0] % num_ranks == 0:
        # The plan without replicas: every expert once, by the drift-best of the greedy and
        # the swap-refined packing (the tightest fit to one window is not always the best).
        packings = [pack_items(load, num_ranks, refine=refine) for refine in (False, True)]
        layouts = [np.argsort(p, kind="stable") for p in packings]  # rank-major experts
        nr_bound = _peak(load, layouts[0], num_ranks)
        scores = [_drift_peak(load, layout, num_ranks) for layout in layouts]
        rank_of = packings[int(np.argmin(scores))] if \
            _peak(load, layouts[1], num_ranks) <= nr_bound else packings[0]
        once = _pack_then_replicate(load, num_slots, num_ranks, False, rank_of)
        candidates += [once, _pack_then_replicate(load, num_slots, num_ranks, True, rank_of)]
        no_replica_peak = _peak(load, once, num_ranks)
        # Whole hot experts swing the next window's peak: split hot experts of the once-each
        # packing into replicas (all at once, or one at a time while the bound holds).
        candidates.append(_pack_then_split(load, num_slots, num_ranks, rank_of))
        candidates.append(_split_within(load, once, num_ranks,
                                        min(greedy_peak, no_replica_peak)))
    return candidates, greedy_peak, no_replica_peak


def _feasible(candidates: list[np.ndarray], load: np.ndarray, num_ranks: int,
              bound: float) -> list[np.ndarray]:
    eps = 1e-9 * max(float(load.sum()), 1.0)
    return [c for c in candidates if _peak(load, c, num_ranks) <= bound + eps]


def _choose(candidates: list[np.ndarray], load: np.ndarray, num_ranks: int,
            bound: float) -> np.ndarray:
    """Among layouts whose peak on `load` is within `bound` (the guarantees), the one with the
    lowest mean peak when each expert's load drifts (the plan serves the *next* window):
    the tightest fit to one window often packs its heavy experts together and loses later."""
    feasible = _feasible(candidates, load, num_ranks, bound)
    scores = [_drift_peak(load, c, num_ranks) for c in feasible]
    return feasible[int(np.argmin(scores))]


@functools.lru_cache(maxsize=64)
def _drift_draws(num_experts: int) -> np.ndarray:
    """The fixed drift draws [NUM_DRIFT_SAMPLES, num_experts] (deterministic, read-only)."""
    draws = np.random.default_rng(0).lognormal(0.0, LOAD_DRIFT_SIGMA,
                                               (NUM_DRIFT_SAMPLES, num_experts))
    draws.setflags(write=False)
    return draws


def _drift_peak(load: np.ndarray, slots: np.ndarray, num_ranks: int) -> float:
    """Mean peak rank load over NUM_DRIFT_SAMPLES draws of per-expert multiplicative drift
    (the same draws for every layout compared: common random numbers)."""
    drift = _drift_draws(load.shape[0])
    per_slot = (drift * (load / np.bincount(slots, minlength=load.shape[0])))[:, slots]
    return float(per_slot.reshape(NUM_DRIFT_SAMPLES, num_ranks, -1).sum(-1).max(-1).mean())


def _replicate_and_pack(load: np.ndarray, num_slots: int, num_ranks: int,
                        refine: bool = True, colocate: bool = False) -> np.ndarray:
    """`colocate`: the swap refinement may put two replicas of one expert on one rank."""
    local = replicate(load, num_slots)  # replica -> expert
    replica_loads = load[local] / np.bincount(local)[local]
    rank_of = pack_items(replica_loads, num_ranks, refine=refine,
                         keys=None if colocate else local)
    return local[np.argsort(rank_of, kind="stable")]  # rank-major slots


def _pack_then_replicate(load: np.ndarray, num_slots: int, num_ranks: int,
                         add_replicas: bool = True,
                         rank_of: np.ndarray | None = None) -> np.ndarray:
    """Pack every expert once, then fill each rank's spare slots: with a replica of a hot
    expert where that does not raise the peak, else with a repeat of one of the rank's own
    experts. With `add_replicas=False` only repeats are used, which leaves every rank's load
    exactly as without replicas: the candidate that makes redundancy never balance worse."""
    num_experts = load.shape[0]
    rank_of = pack_items(load, num_ranks) if rank_of is None else rank_of
    slots_per_rank = num_slots // num_ranks
    layout = [sorted(np.flatnonzero(rank_of == r).tolist(), key=lambda e: -load[e])
              for r in range(num_ranks)]
    if not add_replicas:
        return np.concatenate([np.resize(np.asarray(own, dtype=np.int64), slots_per_rank)
                               for own in layout])

    hosted = np.zeros((num_ranks, num_experts))  # replicas of each expert on each rank
    for r, own in enumerate(layout):
        hosted[r, own] = 1
    counts = np.ones(num_experts)

    def loads_with(rank: int, expert: int) -> np.ndarray:
        """Rank loads after one more replica of `expert` on `rank`."""
        share = load[expert] / (counts[expert] + 1)
        new = rank_load - hosted[:, expert] * (load[expert] / counts[expert] - share)
        new[rank] += share
        return new

    def peaks_with(experts: np.ndarray) -> np.ndarray:
        """[len(experts), ranks]: the peak of `loads_with(rank, expert)` for every pair (the
        rank that gains the share is the peak or the old peak stays: shares are >= 0)."""
        share = load[experts] / (counts[experts] + 1)
        base = rank_load[None, :] - hosted[:, experts].T * \
            (load[experts] / counts[experts] - share)[:, None]
        return np.maximum(base.max(1, keepdims=True), base + share[:, None])

    rank_load = hosted @ load
    for _ in range(num_slots - num_experts):
        open_ranks = [r for r in range(num_ranks) if len(layout[r]) < slots_per_rank]
        top = np.argsort(-(load / counts), kind="stable")[:8]
        peaks = peaks_with(top)
        peak_now = rank_load.max()
        choice = None
        for i, e in enumerate(top.tolist()):
            free = [r for r in open_ranks if not hosted[r, e]]
            if free:
                r = free[int(np.argmin(peaks[i, free]))]
                if peaks[i, r] <= peak_now:
                    choice = (r, e)
                    break
        if choice is None:  # repeat an own expert on the rank where that costs least
            pairs = [(r, e) for r in open_ranks for e in set(layout[r])]
            experts = np.array([e for _, e in pairs])
            costs = peaks_with(experts)[np.arange(len(pairs)), [r for r, _ in pairs]]
            choice = pairs[int(np.argmin(costs))]
        r, e = choice
        rank_load = loads_with(r, e)
        layout[r].append(e)
        hosted[r, e] += 1
        counts[e] += 1
    return np.concatenate([np.asarray(slots, dtype=np.int64) for slots in layout])


def _pack_then_split(load: np.ndarray, num_slots: int, num_ranks: int,
                     rank_of: np.ndarray | None = None) -> np.ndarray:
    """Every expert once on the ranks of the tight once-each packing, the extra replicas
    (`replicate`'s counts) heaviest first onto the lightest rank with room that does not
    hold the expert, then swap refinement without co-located replicas."""
    num_experts = load.shape[0]
    local = replicate(load, num_slots)  # replica -> expert, experts in order
    counts = np.bincount(local, minlength=num_experts)
    weights = load[local] / counts[local]
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])  # each expert's first replica
    pack_of = np.full(num_slots, -1, dtype=np.int64)
    pack_of[first] = pack_items(load, num_ranks) if rank_of is None else rank_of
    capacity = num_slots // num_ranks
    size = np.bincount(pack_of[first], minlength=num_ranks)
    pack_load = np.bincount(pack_of[first], weights[first], minlength=num_ranks)
    extra = np.setdiff1d(np.arange(num_slots), first)
    for item in extra[np.argsort(-weights[extra], kind="stable")]:
        hosts = pack_of[local == local[item]]
        open_ranks = [r for r in range(num_ranks) if size[r] < capacity]
        free = [r for r in open_ranks if r not in hosts] or open_ranks
        rank = min(free, key=lambda r: pack_load[r])
        pack_of[item] = rank
        size[rank] += 1
        pack_load[rank] += weights[item]
    if num_ranks > 1 and capacity > 1:
        _refine_by_swaps(weights, pack_of, pack_load, local)
    return local[np.argsort(pack_of, kind="stable")]


def _split_within(load: np.ndarray, once: np.ndarray, num_ranks: int,
                  bound: float) -> np.ndarray:
    """From the once-each layout (spare slots repeat a rank's own expert), turn repeats into
    replicas of the hottest experts one at a time, each followed by swap refinement, keeping
    a split only while the window's peak stays within `bound`."""
    eps = 1e-9 * max(float(load.sum()), 1.0)
    num_experts, num_slots = load.shape[0], once.shape[0]
    rank_of_slot = np.arange(num_slots) // (num_slots // num_ranks)
    slots = once.copy()
    failed: set[int] = set()
    while len(failed) <= 2 * (num_slots - num_experts):  # bounded work per node
        # The hottest expert per replica next; an expert that failed is not retried.
        per_replica = load / np.bincount(slots, minlength=num_experts)
        order = [int(e) for e in np.argsort(-per_replica, kind="stable") if int(e) not in failed]
        if not order or per_replica[order[0]] <= 0:
            return slots
        expert = order[0]
        held = np.zeros((num_ranks, num_experts), dtype=np.int64)
        np.add.at(held, (rank_of_slot, slots), 1)
        spots = np.flatnonzero((held[rank_of_slot, slots] > 1) & (held[rank_of_slot, expert] == 0))
        if spots.size == 0:
            if not np.any(held[rank_of_slot, slots] > 1):
                return slots  # no repeat left to turn into a replica
            failed.add(expert)
            continue
        rank_load = _rank_loads(load, slots, num_ranks)
        trial = slots.copy()
        trial[spots[np.argmin(rank_load[rank_of_slot[spots]])]] = expert
        weights = (load / np.bincount(trial, minlength=num_experts))[trial]
        pack_of = rank_of_slot.copy()
        _refine_by_swaps(weights, pack_of, np.bincount(pack_of, weights, minlength=num_ranks),
                         trial)
        trial = trial[np.argsort(pack_of, kind="stable")]
        if _peak(load, trial, num_ranks) <= bound + eps:
            slots = trial
        else:
            failed.add(expert)
    return slots


def _rank_loads(load: np.ndarray, slots: np.ndarray, num_ranks: int) -> np.ndarray:
    per_slot = (load / np.bincount(slots, minlength=load.shape[0]))[slots]
    return per_slot.reshape(num_ranks, -1).sum(-1)


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


def pack_items(weights: np.ndarray, num_packs: int, refine: bool = True,
               keys: np.ndarray | None = None) -> np.ndarray:
    """Pack index of every item; each pack gets exactly len(weights) / num_packs items.

    Greedy (heaviest first onto the lightest pack with room), then pairwise swaps that lower
    the heaviest pack; the result is never heavier at its peak than the greedy one.
    """
    num_items = weights.shape[0]
    if num_items % num_packs:
        raise ValueError(f"{num_items} items do not split into {num_packs} equal packs")
    capacity = num_items // num_packs
    pack_of = np.empty(num_items, dtype=np.int64)
    # Open packs in a heap of (load, pack): the lightest, lowest-numbered first.
    heap = [(0.0, pack) for pack in range(num_packs)]
    size = [0] * num_packs
    pack_load = np.zeros(num_packs)
    values = weights.tolist()
    for item in np.argsort(-weights, kind="stable").tolist():
        load, pack = heap[0]
        pack_of[item] = pack
        size[pack] += 1
        load += values[item]
        pack_load[pack] = load
        if size[pack] < capacity:
            heapq.heapreplace(heap, (load, pack))
        else:
            heapq.heappop(heap)
    if refine and capacity > 1 and num_packs > 1:
        _refine_by_swaps(weights, pack_of, pack_load, keys)
    return pack_of


def _refine_by_swaps(weights: np.ndarray, pack_of: np.ndarray, pack_load: np.ndarray,
                     keys: np.ndarray | None = None, max_rounds: int = 1000) -> None:
    """Swap one item of the heaviest pack with one item elsewhere while it lowers the peak.

    Every accepted swap lowers max(load of the two packs) below the current peak, so the
    number of packs at the peak, then the peak itself, decreases: it terminates. With `keys`
    (an item's expert), no swap puts two items of one key in a pack: replicas of one expert
    on one rank would drift together and undo the balance in the next window.
    """
    eps = 1e-9 * max(float(weights.sum()), 1.0)
    num_packs = pack_load.shape[0]
    if keys is not None:
        held = np.zeros((num_packs, int(keys.max()) + 1), dtype=np.int64)
        np.add.at(held, (pack_of, keys), 1)
    for _ in range(max_rounds):
        heavy = int(np.argmax(pack_load))
        peak = pack_load[heavy]
        inside = np.flatnonzero(pack_of == heavy)
        outside = np.flatnonzero(pack_of != heavy)
        delta = weights[inside][:, None] - weights[outside][None, :]  # [in, out] moved off heavy
        other_packs = pack_of[outside][None, :]
        worst = np.maximum(peak - delta, pack_load[other_packs] + delta)
        if keys is not None:
            clash = (held[other_packs, keys[inside][:, None]] > 0) | \
                    (held[heavy, keys[outside]][None, :] > 0)
            worst = np.where(clash, np.inf, worst)
        best = np.unravel_index(int(np.argmin(worst)), worst.shape)
        if worst[best] >= peak - eps:
            return
        a, b = inside[best[0]], outside[best[1]]
        other = pack_of[b]
        pack_load[heavy] -= delta[best]
        pack_load[other] += delta[best]
        pack_of[a], pack_of[b] = other, heavy
        if keys is not None:
            held[heavy, keys[a]] -= 1
            held[other, keys[a]] += 1
            held[other, keys[b]] -= 1
            held[heavy, keys[b]] += 1


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


def placement_from_phy2log(phy2log, num_logical: int, num_ranks: int) -> ExpertPlacement:
    """The placement of a given slot layout [layers, num_physical] (e.g. the initial one,
    slot p holding expert p % num_logical); every expert must have a slot."""
    phy2log = np.asarray(phy2log, dtype=np.int64)
    if phy2log.ndim != 2 or phy2log.shape[1] % num_ranks:
        raise ValueError(f"phy2log must be [layers, slots] with slots divisible by {num_ranks}")
    logcnt = np.stack([np.bincount(row, minlength=num_logical) for row in phy2log])
    if logcnt.shape[1] != num_logical or np.any(logcnt == 0):
        raise ValueError("every logical expert needs at least one slot")
    return ExpertPlacement(phy2log, _log2phy(phy2log, logcnt), logcnt, num_ranks)
