"""Prompt log-probs (SamplingParams.prompt_logprobs) of one step's prefill chunks.

Row j of a chunk (position p = num_computed_tokens + j) predicts the prompt token at p + 1; the
scheduler lists those tokens in `ScheduledRequest.prompt_logprob_token_ids`. The values are
the log-softmax of the model's logits (no sampling processing applies to a prompt position).
Logits are computed a few hundred rows at a time, so a long chunk never holds a
[tokens, vocab] float32 matrix at once. In a low-precision model each target token's logit is
recomputed in fp32 (as compute_logits does for the top logits), so the reported value is
exact however far down the distribution the token sits.
"""
from __future__ import annotations

import torch
from torch import Tensor

from deepinfer.core.scheduler_output import PromptLogprobsChunk, ScheduledRequest, TokenLogprobs

ROWS_PER_SLICE = 256  # logits rows per pass: 256 x 49152 fp32 = 48 MiB


def wants_prompt_logprobs(requests: list[ScheduledRequest]) -> bool:
    return any(r.prompt_logprob_token_ids for r in requests)


@torch.inference_mode()
def compute_prompt_logprobs(model, hidden: Tensor, ordered: list[ScheduledRequest]
                            ) -> dict[str, PromptLogprobsChunk]:
    """`hidden` [T, hidden]: the step's rows, the requests' chunks back to back in `ordered`
    order. Returns a chunk of log-probs for each request that lists target tokens."""
    out: dict[str, PromptLogprobsChunk] = {}
    start = 0
    for r in ordered:
        targets = r.prompt_logprob_token_ids
        if targets:
            rows = hidden[start:start + len(targets)]  # [len(targets), hidden]
            k = r.sampling_params.prompt_logprobs or 0
            out[r.request_id] = PromptLogprobsChunk(
                r.num_computed_tokens + 1, _row_logprobs(model, rows, targets, k))
        start += r.num_new_tokens
    return out


def _row_logprobs(model, rows: Tensor, targets: list[int], k: int) -> list[TokenLogprobs]:
    result: list[TokenLogprobs] = []
    for lo in range(0, len(targets), ROWS_PER_SLICE):
        part = rows[lo:lo + ROWS_PER_SLICE]
        ids = torch.tensor(targets[lo:lo + ROWS_PER_SLICE], dtype=torch.long, device=rows.device)
        logits = model.compute_logits(part)  # [n, vocab] fp32
        if part.dtype != torch.float32:
            exact = exact_token_logits(model, part, ids)
            if exact is not None:
                logits.scatter_(1, ids.unsqueeze(1), exact.unsqueeze(1))
        logp = torch.log_softmax(logits, dim=-1)
        del logits
        token_lp = logp.gather(1, ids.unsqueeze(1))  # [n, 1]
        ranks = (logp > token_lp).sum(dim=-1) + 1
        top_vals, top_ids = logp.topk(max(k, 1), dim=-1)
        token_lp, ranks = token_lp.squeeze(1).tolist(), ranks.tolist()
        top_vals, top_ids = top_vals[:, :k].tolist(), top_ids[:, :k].tolist()
        for j, token in enumerate(ids.tolist()):
            result.append(TokenLogprobs(token_id=token, logprob=token_lp[j], rank=ranks[j],
                                        top_token_ids=top_ids[j], top_logprobs=top_vals[j]))
    return result


def exact_token_logits(model, hidden: Tensor, token_ids: Tensor) -> Tensor | None:
    """[n] fp32 logit of token_ids[i] at row i, from the head's own weight rows; None when the
    model has no plain head weight to read."""
    weight_of = getattr(model, "logits_weight", None)
    weight = weight_of() if weight_of is not None else None
    if weight is None:
        return None
    w = weight.index_select(0, token_ids).float()  # [n, hidden]
    return (w * hidden.float()).sum(dim=-1)
