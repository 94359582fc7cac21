"""The simulator's expert load and EPLB in the loop (sim.expert_load, sim.roofline). Pure, fast:
a 4-MoE-layer DeepSeek-V3 shape (256 experts, top-8) keeps each plan well under a second."""
import numpy as np
import pytest

import deepinfer.moe.eplb as engine_eplb
import deepinfer.sim.expert_load as expert_load
from deepinfer.core.cost_model import ChunkShape
from deepinfer.sim import cluster_from_dict, simulate_workload
from deepinfer.sim.analytic_model import DEEPSEEK_V3_CONFIG, analytic_model, mla_moe_model
from deepinfer.sim.expert_load import ExpertLoadSpec, ExpertLoadTracker, identity_placement, imbalance
from deepinfer.sim.hardware import accelerator
from deepinfer.sim.roofline import RooflineConfig, RooflineStepTime

SMALL = mla_moe_model("small-v3", {**DEEPSEEK_V3_CONFIG, "num_hidden_layers": 7})  # 4 MoE layers
H800 = accelerator("H800")
PREFILL = [ChunkShape(0, 16384)] * 8  # 16k tokens per GPU


def _worker(redundant: int, index: int = 0, model=SMALL, **load) -> RooflineStepTime:
    spec = {"distribution": "zipf", "exponent": 0.8, "drift_per_minute": 0.1, "seed": 0,
            "window_size": 4, "step_interval": 4, **load}
    config = RooflineConfig(num_accelerators=8, ep_size=32, num_redundant_experts=redundant,
                            expert_load=spec)
    return RooflineStepTime(model, H800, config).for_worker(index)


def test_the_planner_called_is_the_engines(monkeypatch):
    assert expert_load.plan_placement is engine_eplb.plan_placement
    calls = []

    def spy(*args, **kwargs):
        calls.append(args[1:])
        return engine_eplb.plan_placement(*args, **kwargs)
    monkeypatch.setattr(expert_load, "plan_placement", spy)
    worker = _worker(32)
    for _ in range(8):
        worker.step_time_s(PREFILL)
    assert calls == [(256 + 32, 32)] * 2  # every step_interval steps: 288 slots over EP32
    assert worker.expert_load_stats()["num_rebalances"] == 2


def test_balanced_loads_give_factor_one():
    shape = _worker(0).ep_shape()
    equal = np.full((shape.num_layers, shape.num_experts), 1000)
    assert imbalance(identity_placement(shape), equal) == 1.0  # 8 experts on every rank
    # The identity layout's 32 spare slots replicate experts 0..31: not balanced on equal loads.
    assert imbalance(identity_placement(_worker(32).ep_shape()), equal) > 1.0
    step = RooflineStepTime(SMALL, H800, RooflineConfig(ep_size=32))
    assert step.breakdown(PREFILL, 1.0) == step.breakdown(PREFILL)
    # One expert with all of a layer's load: its rank carries everything, 32x the mean.
    hot = np.zeros((shape.num_layers, shape.num_experts))
    hot[:, 5] = 1000
    no_replicas = engine_eplb.placement_from_phy2log(
        np.tile(np.arange(256), (shape.num_layers, 1)), 256, 32)
    assert imbalance(no_replicas, hot) == pytest.approx(32.0)
    slower = step.breakdown(PREFILL, 2.0)
    assert slower["linear"] > step.breakdown(PREFILL)["linear"]
    latency = SMALL.num_moe_layers * 2 * step.config.a2a_latency_s  # not load-dependent
    assert slower["all_to_all"] - latency == \
        pytest.approx(2 * (step.breakdown(PREFILL)["all_to_all"] - latency))


def test_skewed_load_is_slower_without_redundant_experts_after_a_rebalance():
    none, spare = _worker(0), _worker(32)
    times = {0: [], 32: []}
    for _ in range(12):  # rebalances after steps 4 and 8
        times[0].append(none.step_time_s(PREFILL))
        times[32].append(spare.step_time_s(PREFILL))
    assert spare.expert_load_stats()["num_rebalances"] == 3
    assert spare.expert_load_stats()["moved_bytes"] > 0
    # Before any rebalance both run the identity layout on a Zipf load: far from balanced.
    assert none.expert_load.placement.num_physical_experts == 256
    after_0, after_32 = np.mean(times[0][4:8]), np.mean(times[32][4:8])
    assert after_32 < after_0
    assert after_32 < np.mean(times[32][:4])  # the rebalance itself helped
    stats = spare.expert_load_stats()
    assert stats["balancedness_mean"] > none.expert_load_stats()["balancedness_mean"]


def test_the_rebalance_costs_its_weight_moves_once():
    worker = _worker(32, eplb=True)
    steps = [worker.step_time_s(PREFILL) for _ in range(5)]
    moves_s = worker.expert_load_stats()["rebalance_s"]
    assert moves_s > 0
    shape = worker.ep_shape()
    # The busiest receiving rank's bytes, no more than all its slots over the NIC.
    assert moves_s <= 9 * shape.num_layers * shape.expert_bytes / shape.network_bytes_per_s
    frozen = _worker(32, eplb=False)
    frozen_steps = [frozen.step_time_s(PREFILL) for _ in range(5)]
    assert frozen.expert_load_stats()["num_rebalances"] == 0
    # Same draws up to the rebalance: step 4 differs by exactly the move time.
    assert steps[:3] == frozen_steps[:3]
    assert steps[3] == pytest.approx(frozen_steps[3] + moves_s)


def test_deterministic_per_seed():
    def run(seed, index=0):
        worker = _worker(32, index=index, seed=seed)
        return [worker.step_time_s(PREFILL) for _ in range(5)] + \
            [worker.step_time_s([ChunkShape(4000, 1)] * 64)]
    assert run(0) == run(0)
    assert run(0) != run(1)
    assert run(0, index=1) != run(0)  # each worker samples its own steps


def test_initial_planned_placement_beats_identity():
    planned, identity = _worker(32, initial="planned", eplb=False), _worker(32, eplb=False)
    for _ in range(3):
        planned.step_time_s(PREFILL)
        identity.step_time_s(PREFILL)
    assert planned.expert_load_stats()["imbalance_mean"] < \
        identity.expert_load_stats()["imbalance_mean"]


def test_uniform_load_is_nearly_balanced_at_large_batches():
    worker = _worker(0, distribution="uniform", drift_per_minute=0.0)
    worker.step_time_s(PREFILL)
    assert 1.0 < worker.expert_load_stats()["imbalance_mean"] < 1.05  # sampling noise only


# Step times of today's roofline (before expert_load existed), for the bit-equal check.
BEFORE = {
    (32, 32, True): [2.7071127807598656, 0.028061669456598104, 0.01290206749361232,
                     0.07547053349131358],
    (144, 32, False): [3.8631981610666664, 0.021389909026747356, 0.00931630049355978,
                       0.18949362773333334],
}
BATCHES = [[ChunkShape(0, 16384)] * 8, [ChunkShape(4400, 1)] * 512, [ChunkShape(1000, 1)] * 8,
           [ChunkShape(2478, 1922), ChunkShape(0, 4400)]]


def test_no_expert_load_is_bit_equal_to_the_balanced_roofline():
    model = analytic_model("deepseek-v3")
    for (ep, redundant, dedup), expected in BEFORE.items():
        config = RooflineConfig(ep_size=ep, num_redundant_experts=redundant, node_dedup=dedup)
        step = RooflineStepTime(model, H800, config)
        assert step.for_worker(3) is step and step.expert_load_stats() is None
        assert [step.step_time_s(b) for b in BATCHES] == expected


def _cluster(load):
    cost = {"accelerator": "H800", "model": "deepseek-v3", "num_accelerators": 8,
            "ep_size": 32, "num_redundant_experts": 32}
    if load is not None:
        cost["expert_load"] = load
    return cluster_from_dict({"cost": cost, "engine": {"block_size": 64, "num_kv_blocks": 4096},
                              "pools": {"colocated": {"workers": 2}}})


def test_cluster_file_key_and_simulation():
    from deepinfer.bench.workloads import WorkloadConfig, build_workload
    workload = build_workload(WorkloadConfig(kind="random", num_prompts=8, input_len=256,
                                             output_len=4, request_rate=float("inf")))
    balanced = simulate_workload(_cluster(None), workload)
    # Zipf loads on the identity layout (no rebalance within the run): the busiest rank
    # sets the pace, so the same workload takes longer than with every rank at the mean.
    skewed = simulate_workload(_cluster({"exponent": 0.8, "window_size": 2, "step_interval": 1000}),
                               workload)
    workers = skewed.simulator.pools["colocated"]
    assert all(w.step_model.expert_load_stats()["num_steps"] == w.num_steps for w in workers)
    assert workers[0].step_model is not workers[1].step_model
    assert skewed.duration_s > balanced.duration_s
    for w in balanced.simulator.pools["colocated"]:
        assert w.step_model.expert_load_stats() is None
    with pytest.raises(ValueError, match="expert_load: unknown keys"):
        _cluster({"exponnent": 0.8})
    with pytest.raises(ValueError, match="distribution"):
        _cluster({"distribution": "pareto"})
    with pytest.raises(ValueError, match="window_size"):
        _cluster({"window_size": 0})
