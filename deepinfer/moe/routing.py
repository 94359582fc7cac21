"""Expert selection: router logits -> (top-k weights, top-k expert ids). A pure function of
its tensors and a `MoEConfig`, so the expert-parallel layer and tests share it.

Semantics follow the reference implementations:

- softmax (Mixtral, Qwen3-MoE): probs = softmax(logits) in fp32, top-k of probs, optionally
  renormalised to sum 1 (`norm_topk_prob`).
- sigmoid (DeepSeek-V3 "noaux_tc"): scores = sigmoid(logits); the selection uses
  scores + e_score_correction_bias (a load-balancing bias that must never reach the weights),
  restricted to the `topk_group` best of `n_group` groups, a group scored by the sum of its
  two best biased scores; weights are the unbiased scores of the chosen experts, renormalised
  when `norm_topk_prob`, then times `routed_scaling_factor`.
"""
from __future__ import annotations

import torch
from torch import Tensor

from deepinfer.moe.moe_config import MoEConfig


def select_experts(router_logits: Tensor, config: MoEConfig,
                   correction_bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """router_logits [T, E] -> (weights [T, k] float32, expert ids [T, k] long)."""
    logits = router_logits.float()
    k = config.num_experts_per_tok
    if config.scoring_func == "softmax":
        scores = torch.softmax(logits, dim=-1)
        choice = scores
    else:
        scores = logits.sigmoid()
        choice = scores if correction_bias is None else scores + correction_bias.float()
    if config.n_group > 1:
        choice = _mask_to_best_groups(choice, config.n_group, config.topk_group,
                                      per_group_top=2 if config.scoring_func == "sigmoid" else 1)
    topk_ids = choice.topk(k, dim=-1).indices  # [T, k]
    weights = scores.gather(1, topk_ids)  # [T, k] unbiased scores
    if config.norm_topk_prob:
        denom = weights.sum(dim=-1, keepdim=True)
        if config.scoring_func == "sigmoid":
            denom = denom + 1e-20  # DeepSeek's guard against an all-zero sigmoid row
        weights = weights / denom
    if config.routed_scaling_factor != 1.0:
        weights = weights * config.routed_scaling_factor
    return weights, topk_ids


def _mask_to_best_groups(choice: Tensor, n_group: int, topk_group: int, per_group_top: int) -> Tensor:
    """`choice` with experts outside the `topk_group` best groups set to -inf."""
    num_tokens, num_experts = choice.shape
    grouped = choice.view(num_tokens, n_group, num_experts // n_group)  # [T, G, E/G]
    group_scores = grouped.topk(min(per_group_top, grouped.shape[-1]), dim=-1).values.sum(-1)  # [T, G]
    best = group_scores.topk(topk_group, dim=-1).indices  # [T, topk_group]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)  # [T, G]
    keep = keep.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
    return choice.masked_fill(~keep, float("-inf"))
