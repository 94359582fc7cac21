"""Prompt lookup (n-gram) drafting: no weights. Pure (numpy).

For the longest n in [min_n, max_n] whose last n tokens occurred earlier in the sequence
(prompt and output alike), propose the tokens that followed the most recent earlier
occurrence (one with k tokens after it, if any). Code edits and refactors copy long runs of their prompt, so the proposals are
often right. Proposals are deterministic (q is one-hot for the verifier).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from deepinfer.spec.drafter import DraftRequest


def propose_ngram(token_ids: Sequence[int], min_n: int, max_n: int, num_drafts: int) -> list[int]:
    """Up to `num_drafts` tokens that followed the latest earlier match of the longest
    suffix n-gram (min_n <= n <= max_n); [] when no suffix of length min_n recurs."""
    length = len(token_ids)
    if num_drafts <= 0 or length < min_n + 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)  # [L]
    # Candidate ends i < L - 1 of an earlier occurrence: tokens[i] == last token.
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    if ends.size == 0:
        return []
    match_len = np.ones(ends.size, dtype=np.int64)
    alive = np.ones(ends.size, dtype=bool)
    for j in range(1, min(max_n, length - 1)):
        ok = ends >= j
        ok[ok] &= tokens[ends[ok] - j] == tokens[length - 1 - j]
        alive &= ok
        if not alive.any():
            break
        match_len += alive
    best = match_len.max()
    if best < min_n:
        return []
    best_ends = ends[match_len == best]
    # The most recent longest match with a full continuation, else the earliest (longest one).
    full = best_ends[best_ends + num_drafts < length]
    end = full[-1] if full.size else best_ends[0]
    return tokens[end + 1:end + 1 + num_drafts].tolist()


class NgramDrafter:
    """The `Drafter` for method "ngram": stateless."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int,
                 prompt_lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, requests: list[DraftRequest]) -> dict[str, list[int]]:
        out = {}
        for r in requests:
            if r.is_decode and r.max_num_drafts > 0:
                drafts = propose_ngram(r.token_ids, self.min_n, self.max_n,
                                       min(self.k, r.max_num_drafts))
                if drafts:
                    out[r.request_id] = drafts
        return out

    def remove(self, request_ids: Iterable[str]) -> None:
        pass

    def take_draft_probs(self, request_id: str, draft_token_ids: list[int]) -> None:
        return None
