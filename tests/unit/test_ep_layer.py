"""The expert-parallel MoE layer in one process (LocalDispatcher, one rank holding every slot):
same outputs as MoEExperts with and without replicas, replicas share a hot expert's tokens,
loads are counted per slot, and a rebalance moves weights without changing any output."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from deepinfer.moe.moe_config import MoEConfig
from deepinfer.moe.dispatch import LocalDispatcher
from deepinfer.moe.ep_experts import ExpertParallelExperts
from deepinfer.moe.eplb import placement_from_phy2log
from deepinfer.moe.eplb_config import EPLBConfig
from deepinfer.moe.expert_parallel import ExpertParallelRuntime
from deepinfer.moe.layer import MoEExperts, SparseMoEBlock

E, H, I, K = 8, 16, 12, 2


def full_experts(seed: int = 0) -> MoEExperts:
    gen = torch.Generator().manual_seed(seed)
    m = MoEExperts(E, H, I, torch.float32)
    m.gate_up_proj.data = torch.randn(E, 2 * I, H, generator=gen) * 0.3
    m.down_proj.data = torch.randn(E, H, I, generator=gen) * 0.3
    return m


def ep_layer(full: MoEExperts, phy2log: np.ndarray) -> ExpertParallelExperts:
    num_physical = phy2log.shape[0]
    layer = ExpertParallelExperts(E, num_physical, 0, 1, H, I, torch.float32,
                                  LocalDispatcher(num_physical))
    p = placement_from_phy2log(phy2log[None], E, 1)
    layer.set_mapping(p.phy2log[0], p.log2phy[0], p.logcnt[0])
    layer.load_local_slots(full.gate_up_proj, full.down_proj)
    return layer


def batch(num_tokens: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, H, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(num_tokens)])
    return x, torch.rand(num_tokens, K, generator=gen), ids


@pytest.mark.parametrize("phy2log", [np.arange(E), np.arange(E + 4) % E,
                                     np.array([3, 3, 3, 0, 1, 2, 4, 5, 6, 7, 7, 1])])
def test_matches_moe_experts_with_any_slot_layout(phy2log):
    full = full_experts()
    layer = ep_layer(full, phy2log)
    x, w, ids = batch(9)
    torch.testing.assert_close(layer(x, w, ids), full(x, w, ids), rtol=1e-5, atol=1e-6)
    assert layer(x[:0], w[:0], ids[:0]).shape == (0, H)


def test_replicas_share_a_hot_experts_tokens_and_loads_are_counted_per_slot():
    full = full_experts()
    layer = ep_layer(full, np.array([0, 1, 2, 3, 4, 5, 6, 7, 0, 0]))  # expert 0 on slots 0, 8, 9
    x = torch.randn(30, H)
    ids = torch.stack([torch.tensor([0, 1])] * 30)
    layer(x, torch.ones(30, K), ids)
    load = layer.take_slot_load().tolist()
    assert load[0] == load[8] == load[9] == 10 and load[1] == 30 and sum(load) == 60
    assert layer.take_slot_load().sum() == 0  # taken


def tiny_moe_model() -> nn.Module:
    config = MoEConfig(num_experts=E, num_experts_per_tok=K, moe_intermediate_size=I)
    torch.manual_seed(0)
    blocks = nn.ModuleList(SparseMoEBlock(config, H, torch.float32) for _ in range(2))
    for block in blocks:
        block.gate.weight.data = torch.randn(E, H)
        block.experts.gate_up_proj.data = torch.randn(E, 2 * I, H) * 0.3
        block.experts.down_proj.data = torch.randn(E, H, I) * 0.3
    return blocks


def run(blocks: nn.Module, x: torch.Tensor) -> torch.Tensor:
    for block in blocks:
        x = x + block(x)
    return x


@pytest.fixture
def always_apply_plans(monkeypatch):
    """One rank is always balanced, so no plan gains: let every plan through to test moves."""
    monkeypatch.setattr("deepinfer.moe.rebalancer.MIN_BALANCEDNESS_GAIN", -1.0)


def test_runtime_rebalance_moves_weights_and_keeps_outputs(always_apply_plans):
    model = tiny_moe_model()
    x = torch.randn(12, H)
    want = run(model, x)
    original = model[0].experts.gate_up_proj.clone()  # [E, 2I, H] before the swap
    runtime = ExpertParallelRuntime(model, 0, 1, eplb=EPLBConfig(window_size=4, step_interval=2,
                                                                  num_redundant_experts=4),
                                    num_redundant_experts=4)
    assert runtime.redundant_expert_bytes() == 4 * (3 * H * I * 4) * 2
    torch.testing.assert_close(run(model, x), want, rtol=1e-5, atol=1e-5)
    assert runtime.end_step() is None  # step 1: not due
    runtime.run_empty_step()  # no tokens: nothing counted, nothing fails
    report = runtime.end_step()  # step 2: due
    assert report is not None and report.num_moved_slots > 0
    assert min(report.balancedness_after) >= min(report.balancedness_before) - 1e-9
    layer = runtime.layers[0]
    assert np.array_equal(layer.phy2log, runtime.placement.phy2log[0])
    for slot, expert in enumerate(layer.phy2log):  # every slot holds its new expert's weights
        assert torch.equal(layer.gate_up_proj[slot], original[expert])
    torch.testing.assert_close(run(model, x), want, rtol=1e-5, atol=1e-5)


def test_runtime_checks_its_inputs():
    with pytest.raises(ValueError, match="MoE"):
        ExpertParallelRuntime(nn.Linear(2, 2), 0, 1)
    with pytest.raises(ValueError, match="divide"):
        ExpertParallelRuntime(tiny_moe_model(), 0, 3, num_redundant_experts=0)


def test_log_balancedness_logs_every_step(caplog):
    model = tiny_moe_model()
    runtime = ExpertParallelRuntime(model, 0, 1, eplb=EPLBConfig(step_interval=100,
                                                                  log_balancedness=True))
    run(model, torch.randn(5, H))
    with caplog.at_level("INFO", logger="deepinfer.moe.expert_parallel"):
        runtime.end_step()
    assert "EPLB step 1: balancedness 1.000" in caplog.text  # one rank is always balanced


def test_a_plan_that_gains_nothing_moves_nothing():
    model = tiny_moe_model()
    runtime = ExpertParallelRuntime(model, 0, 1, eplb=EPLBConfig(num_redundant_experts=4),
                                    num_redundant_experts=4)
    run(model, torch.randn(40, H))
    runtime.end_step()
    report = runtime.rebalance_now()  # one rank: balancedness is 1 before and after
    assert report.num_moved_slots == 0 and report.balancedness_before == [1.0, 1.0]


def test_a_second_rebalance_on_the_same_loads_moves_nothing(always_apply_plans):
    model = tiny_moe_model()
    runtime = ExpertParallelRuntime(model, 0, 1, eplb=EPLBConfig(window_size=10, step_interval=100,
                                                                  num_redundant_experts=4),
                                    num_redundant_experts=4)
    run(model, torch.randn(40, H))
    runtime.end_step()
    first = runtime.rebalance_now()
    assert first.num_moved_slots > 0
    again = runtime.rebalance_now()  # same window, same plan: aligned to itself, no move
    assert again.num_moved_slots == 0 and again.moved_bytes == 0


def test_a_scheduled_rebalance_plans_off_the_step_path(always_apply_plans, monkeypatch):
    """With plan_ahead_steps the due step only agrees on the window; a background thread plans
    and the moves happen plan_ahead_steps later (the same step on every rank), outputs
    unchanged. A forced rebalance still plans at once and drops a plan still pending."""
    import threading

    import deepinfer.moe.rebalancer as rebalancer
    planner_threads = []
    plan = rebalancer.plan_placement

    def recording_plan(*args, **kwargs):
        planner_threads.append(threading.get_ident())
        return plan(*args, **kwargs)
    monkeypatch.setattr(rebalancer, "plan_placement", recording_plan)
    model = tiny_moe_model()
    x = torch.randn(12, H)
    want = run(model, x)
    runtime = ExpertParallelRuntime(model, 0, 1, eplb=EPLBConfig(
        window_size=4, step_interval=4, num_redundant_experts=4, plan_ahead_steps=2),
        num_redundant_experts=4)
    before = runtime.placement.phy2log.copy()
    reports = []
    for step in range(1, 7):
        torch.testing.assert_close(run(model, x), want, rtol=1e-5, atol=1e-5)
        reports.append(runtime.end_step())
        if step == 4:  # due: window agreed, planning in the background, nothing moved yet
            assert runtime.rebalancer.pending and np.array_equal(runtime.placement.phy2log, before)
    assert reports[:5] == [None] * 5
    report = reports[5]  # step 6 = 4 + plan_ahead_steps
    assert report.step == 6 and report.num_moved_slots > 0 and report.plan_s > 0
    assert planner_threads and threading.get_ident() not in planner_threads
    assert not np.array_equal(runtime.placement.phy2log, before)
    torch.testing.assert_close(run(model, x), want, rtol=1e-5, atol=1e-5)
    for _ in range(2):  # step 8: due again; a forced rebalance supersedes the pending plan
        run(model, x)
        runtime.end_step()
    assert runtime.rebalancer.pending
    forced = runtime.end_step(force_rebalance=True)
    assert forced is not None and not runtime.rebalancer.pending
    assert planner_threads[-1] == threading.get_ident()  # planned at once, on the step path
    torch.testing.assert_close(run(model, x), want, rtol=1e-5, atol=1e-5)


def test_plan_ahead_default_is_a_quarter_interval_capped():
    assert EPLBConfig(step_interval=3).plan_ahead == 0  # short intervals: plan at the step
    assert EPLBConfig(step_interval=16).plan_ahead == 4
    assert EPLBConfig(step_interval=3000).plan_ahead == 64
    assert EPLBConfig(step_interval=3000, plan_ahead_steps=0).plan_ahead == 0
    assert EPLBConfig.from_json('{"plan_ahead_steps": 8}').plan_ahead == 8
    with pytest.raises(ValueError, match="plan_ahead_steps"):
        EPLBConfig(plan_ahead_steps=-2)
