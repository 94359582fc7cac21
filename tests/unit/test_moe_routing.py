"""Expert selection (`moe.routing.select_experts`) on hand-made router logits, the MoE config
checks, and the grouped expert compute against a naive per-expert loop."""
from __future__ import annotations

import math

import pytest
import torch

from deepinfer.moe.moe_config import MoEConfig, moe_config_from_hf
from deepinfer.moe.layer import MoEExperts, naive_expert_loop
from deepinfer.moe.routing import select_experts


def _softmax_cfg(**kw) -> MoEConfig:
    return MoEConfig(**{**dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8), **kw})


def test_softmax_top_k_with_and_without_renormalisation():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    probs = torch.softmax(logits, -1)[0]
    w, ids = select_experts(logits, _softmax_cfg(norm_topk_prob=False))
    assert ids.tolist() == [[1, 2]]
    assert torch.allclose(w[0], probs[[1, 2]])
    w, ids = select_experts(logits, _softmax_cfg(norm_topk_prob=True))
    assert torch.allclose(w[0], probs[[1, 2]] / probs[[1, 2]].sum()) and abs(w.sum().item() - 1) < 1e-6


def _sigmoid_cfg(**kw) -> MoEConfig:
    base = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=8, scoring_func="sigmoid",
                use_correction_bias=True, norm_topk_prob=False)
    return MoEConfig(**{**base, **kw})


def test_sigmoid_bias_changes_selection_but_not_weights():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0, -4.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 0.9, 0.0, 0.0, 0.0, 0.0])
    w, ids = select_experts(logits, _sigmoid_cfg(), bias)
    assert sorted(ids[0].tolist()) == [0, 3]  # sigmoid(0)+0.9 = 1.4 beats sigmoid(2) = 0.88
    by_id = dict(zip(ids[0].tolist(), w[0].tolist()))
    assert math.isclose(by_id[3], 0.5, rel_tol=1e-6)  # unbiased sigmoid(0)
    assert math.isclose(by_id[0], 1 / (1 + math.exp(-3)), rel_tol=1e-6)


def test_grouped_top_k_restricts_to_best_groups_and_scales():
    # 4 groups of 2. Group scores (sum of the top 2): g0 = s0+s1, ... Expert 6 alone is the
    # best single expert, but its group (with expert 7 very low) loses to groups 0 and 1.
    logits = torch.tensor([[2.0, 1.9, 1.8, 1.7, -5.0, -5.0, 2.5, -6.0]])
    cfg = _sigmoid_cfg(n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)
    w, ids = select_experts(logits, cfg, torch.zeros(8))
    assert sorted(ids[0].tolist()) == [0, 1]
    assert math.isclose(w.sum().item(), 2.5, rel_tol=1e-6)
    ungrouped = _sigmoid_cfg(norm_topk_prob=True)
    assert sorted(select_experts(logits, ungrouped, torch.zeros(8))[1][0].tolist()) == [0, 6]


@pytest.mark.parametrize("kw, message", [
    (dict(scoring_func="sparsemax"), "scoring_func"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok"),
    (dict(n_group=3), "n_group"),
    (dict(n_group=2, topk_group=3), "topk_group"),
])
def test_bad_moe_configs_are_rejected(kw, message):
    with pytest.raises(ValueError, match=message):
        _softmax_cfg(**kw)


def test_qwen3_moe_sparse_layers_follow_step_and_mlp_only_layers():
    cfg = moe_config_from_hf("qwen3_moe", {
        "num_hidden_layers": 6, "num_experts": 4, "num_experts_per_tok": 1, "moe_intermediate_size": 8,
        "decoder_sparse_step": 2, "mlp_only_layers": [5]})
    assert [cfg.is_moe_layer(i) for i in range(6)] == [False, True, False, True, False, False]
    with pytest.raises(ValueError, match="topk_method"):
        moe_config_from_hf("deepseek_v3", {"num_hidden_layers": 2, "n_routed_experts": 4,
                                           "num_experts_per_tok": 2, "moe_intermediate_size": 8,
                                           "topk_method": "group_limited_greedy"})
    v2 = {"num_hidden_layers": 2, "n_routed_experts": 8, "num_experts_per_tok": 3,
          "moe_intermediate_size": 8, "n_group": 2, "topk_group": 1}
    assert moe_config_from_hf("deepseek_v2", v2).n_group == 1  # greedy: groups ignored
    grouped = moe_config_from_hf("deepseek_v2", {**v2, "topk_method": "group_limited_greedy"})
    assert grouped.n_group == 2 and grouped.scoring_func == "softmax" and not grouped.use_correction_bias
    with pytest.raises(ValueError, match="topk_method"):
        moe_config_from_hf("deepseek_v2", {**v2, "topk_method": "noaux_tc"})


def test_softmax_group_limited_greedy_scores_groups_by_best_expert():
    # Groups {0..3}, {4..7}. Group 1 has the single best expert; group 0 the better pair.
    logits = torch.tensor([[2.0, 1.9, 1.8, 0.0, 2.2, -3.0, -2.5, -2.0]])
    cfg = MoEConfig(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=8, n_group=2,
                    topk_group=1, norm_topk_prob=False)
    weights, ids = select_experts(logits, cfg)
    assert sorted(ids[0].tolist()) == [4, 6, 7]  # best group by max; its best 3 experts
    assert torch.allclose(weights[0], torch.softmax(logits, -1)[0, ids[0]])


@pytest.mark.parametrize("num_tokens, top_k", [(1, 1), (5, 2), (64, 3)])
def test_grouped_experts_equal_naive_loop(num_tokens, top_k):
    gen = torch.Generator().manual_seed(num_tokens)
    experts = MoEExperts(num_experts=6, hidden_size=16, intermediate_size=12, dtype=torch.float32)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=gen))
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=gen))
    x = torch.randn(num_tokens, 16, generator=gen)
    logits = torch.randn(num_tokens, 6, generator=gen)
    cfg = MoEConfig(num_experts=6, num_experts_per_tok=top_k, moe_intermediate_size=12)
    weights, ids = select_experts(logits, cfg)
    grouped = experts(x, weights, ids)
    assert torch.allclose(grouped, naive_expert_loop(experts, x, weights, ids), atol=1e-5, rtol=1e-5)
    # Each token really is the weighted sum of its own experts.
    t = num_tokens - 1
    manual = sum(weights[t, j] * naive_expert_loop(experts, x[t:t + 1], torch.ones(1, 1), ids[t:t + 1, j:j + 1])[0]
                 for j in range(top_k))
    assert torch.allclose(grouped[t], manual, atol=1e-5)
