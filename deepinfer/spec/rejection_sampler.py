"""Accepting draft tokens so that the output is distributed exactly as the target's.

Two cases, both standard speculative sampling (Leviathan et al. 2023, Chen et al. 2023):

* q one-hot (greedy requests; drafters that pick tokens deterministically: n-gram, argmax):
  accepting draft d with probability min(1, p(d)/1) = p(d) and, on rejection, sampling the
  residual max(0, p - onehot(d)) ∝ p without d, is the same as drawing the target's own token
  y ~ p and accepting iff y == d. So each position's token is drawn exactly as without
  speculation (same (seed, position) noise) and the accepted drafts are the longest prefix
  that agrees: a seeded request gives the same tokens with and without speculation.
* q given (a drafter that sampled its drafts from q): accept d_j iff u_j < p_j(d_j) / q_j(d_j)
  with u_j ~ U(0, 1); at the first rejection emit a token from normalise(max(0, p_j - q_j));
  after k acceptances emit a bonus token from p_k.
"""
from __future__ import annotations

import torch
from torch import Tensor


def num_matching(target_token_ids: list[int], draft_token_ids: list[int]) -> int:
    """Accepted drafts when the target's token at each position is known: the length of the
    longest prefix on which the drafts agree with it."""
    n = 0
    for target, draft in zip(target_token_ids, draft_token_ids):
        if target != draft:
            break
        n += 1
    return n


def rejection_sample(target_probs: Tensor, draft_probs: Tensor, draft_token_ids: list[int],
                     uniforms: Tensor, noise: Tensor) -> list[int]:
    """Tokens one request emits: its accepted drafts, then one token from the residual at the
    first rejection or from the last target row.

    target_probs [k + 1, V] (p, after temperature and truncation), draft_probs [k, V] (q the
    drafts were sampled from), uniforms [k] in [0, 1), noise [k + 1, V] Exp(1) (a row's
    sample is argmax(dist / noise), the exponential race)."""
    k = len(draft_token_ids)
    drafts = torch.tensor(draft_token_ids, dtype=torch.long, device=target_probs.device)
    rows = torch.arange(k, device=target_probs.device)
    p_draft = target_probs[rows, drafts]  # [k]
    q_draft = draft_probs[rows, drafts]  # [k]
    accepted = (uniforms * q_draft < p_draft).tolist()
    for j in range(k):
        if not accepted[j]:
            residual = (target_probs[j] - draft_probs[j]).clamp_min(0.0)  # [V]
            if not bool(residual.sum() > 0):  # p == q on the support: nothing to correct
                residual = target_probs[j]
            return draft_token_ids[:j] + [int((residual / noise[j]).argmax())]
    return list(draft_token_ids) + [int((target_probs[k] / noise[k]).argmax())]
