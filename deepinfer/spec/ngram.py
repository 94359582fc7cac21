"""Prompt lookup (n-gram) drafting: no weights. Pure.

For the longest n in [min_n, max_n] whose last n tokens occurred earlier in the sequence
(prompt and output alike), propose the tokens that followed the most recent earlier
occurrence (one with k tokens after it, if any, else the earliest: it has the most after it).
Code edits and refactors copy long runs of their prompt, so the proposals are often right.
Proposals are deterministic (q is one-hot for the verifier).

Each request keeps an `NgramIndex`: for every n, a dict from each n-gram to the positions it
ended at, extended with the tokens a step appended, so a proposal is a few dict lookups rather
than a rescan of the whole sequence (vLLM rescans with a KMP pass per step).

Draft length: a match of only `WEAK_MATCH_LEN` tokens predicts poorly (on the code-editing
benchmark's outputs, drafts after a 2-token match were accepted at positions 1..5 with
probability ~0.5, 0.4, 0.3, 0.25, 0.2, after a 5-token match ~0.9..0.75), and every draft
costs a verification row, so such matches propose at most `WEAK_MATCH_MAX_DRAFTS`.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from deepinfer.spec.drafter import DraftRequest

WEAK_MATCH_LEN = 2
WEAK_MATCH_MAX_DRAFTS = 3


class NgramIndex:
    """Where each n-gram (min_n <= n <= max_n) of one growing token sequence ended.

    Only n-grams with at least one token after them are indexed (an occurrence must end
    before the sequence's last token to propose anything), so a lookup of the sequence's own
    suffix finds earlier occurrences only (overlapping ones included)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self.tokens: list[int] = []
        self._ends: list[dict[tuple[int, ...], list[int]]] = [{} for _ in range(max_n - min_n + 1)]

    def extend(self, token_ids: Sequence[int]) -> None:
        """Catch up with `token_ids`, which must start with the tokens indexed so far."""
        tokens = self.tokens
        for token in token_ids[len(tokens):]:
            end = len(tokens) - 1  # the n-grams ending here now have a token after them
            tokens.append(token)
            for n, ends in enumerate(self._ends, self.min_n):
                if end >= n - 1:
                    ends.setdefault(tuple(tokens[end - n + 1:end + 1]), []).append(end)

    def follows(self, token_ids: Sequence[int]) -> bool:
        """Whether `token_ids` continue the indexed tokens (cheap check: ends and length)."""
        n = len(self.tokens)
        return n <= len(token_ids) and (n == 0 or (token_ids[0] == self.tokens[0]
                                                   and token_ids[n - 1] == self.tokens[n - 1]))

    def match(self, num_drafts: int) -> tuple[int, int]:
        """(n, end) of the longest suffix n-gram's chosen earlier occurrence; (0, -1) if none."""
        tokens = self.tokens
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            ends = self._ends[n - self.min_n].get(tuple(tokens[length - n:]))
            if ends:
                # the latest with num_drafts tokens after it: at most num_drafts from the back
                for end in reversed(ends):
                    if end + num_drafts < length:
                        return n, end
                return n, ends[0]
        return 0, -1

    def propose(self, num_drafts: int) -> list[int]:
        if num_drafts <= 0:
            return []
        n, end = self.match(num_drafts)
        if n == 0:
            return []
        if n <= WEAK_MATCH_LEN:
            num_drafts = min(num_drafts, WEAK_MATCH_MAX_DRAFTS)
        return self.tokens[end + 1:end + 1 + num_drafts]


def propose_ngram(token_ids: Sequence[int], min_n: int, max_n: int, num_drafts: int) -> list[int]:
    """Up to `num_drafts` tokens that followed the chosen earlier match of the longest
    suffix n-gram (min_n <= n <= max_n); [] when no suffix of length min_n recurs.
    Stateless (indexes the whole sequence): the drafter keeps an index per request."""
    index = NgramIndex(min_n, max_n)
    index.extend(token_ids)
    return index.propose(num_drafts)


class NgramDrafter:
    """The `Drafter` for method "ngram": one `NgramIndex` per running request."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int,
                 prompt_lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self._indexes: dict[str, NgramIndex] = {}

    def propose(self, requests: list[DraftRequest]) -> dict[str, list[int]]:
        out = {}
        for r in requests:
            index = self._indexes.get(r.request_id)
            if index is None or not index.follows(r.token_ids):
                index = self._indexes[r.request_id] = NgramIndex(self.min_n, self.max_n)
            index.extend(r.token_ids)
            if r.is_decode and r.max_num_drafts > 0:
                drafts = index.propose(min(self.k, r.max_num_drafts))
                if drafts:
                    out[r.request_id] = drafts
        return out

    def remove(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._indexes.pop(request_id, None)

    def take_draft_probs(self, request_id: str, draft_token_ids: list[int]) -> None:
        return None
