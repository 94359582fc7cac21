"""The token mask of structured outputs, applied to a step's logits rows before sampling.

A request's matcher is a function of its committed output: before each row is masked, the
matcher is brought in step with the row's output tokens (the tail of `history_token_ids`),
rolling back what the row no longer has and accepting what it adds. So nothing needs to
tell the masker about accepted tokens, preemption, a failed step that is redone, or a decode
worker that continues another worker's request: it reads the output it is given. A
verification of speculative drafts masks its row j after drafts [:j]; once the drafts are
settled the next step rolls the matcher back to the accepted ones. Matchers are xgrammar's or
llguidance's (structured/grammars.py picks per spec); both fill the same bitmask.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import xgrammar as xgr
from torch import Tensor

from deepinfer.core.scheduler_output import ScheduledRequest
from deepinfer.core.request_fault import RequestFault
from deepinfer.structured.grammars import GrammarCache

# Past this many tokens to undo, rebuilding the matcher and replaying the output is cheaper.
MAX_ROLLBACK_TOKENS = 64


@dataclass
class _Tracked:
    key: tuple
    matcher: Any  # xgr.GrammarMatcher, or structured.llguidance_grammar.LLGuidanceMatcher
    accepted: list[int] = field(default_factory=list)  # output tokens the matcher has taken
    # Stop tokens after the grammar's end (ignore_eos keeps sampling them): at the tail of
    # `accepted`, never given to the matcher, which accepts nothing once terminated.
    past_end: int = 0


class GrammarMasker:
    """Per-request grammar matchers of one sampler."""

    def __init__(self, cache: GrammarCache) -> None:
        self.cache = cache
        self._tracked: dict[str, _Tracked] = {}

    def __len__(self) -> int:
        return len(self._tracked)

    def forget(self, request_ids) -> None:
        for request_id in request_ids:
            self._tracked.pop(request_id, None)

    def apply(self, logits: Tensor, rows: list[ScheduledRequest]) -> None:
        """Mask, in place, the logits [N, V] of the rows with structured outputs."""
        index = [i for i, r in enumerate(rows) if r.sampling_params.structured_outputs is not None]
        if not index:
            return
        vocab = logits.shape[1]
        bitmask = xgr.allocate_token_bitmask(len(rows), vocab)  # all allowed
        only_stop = []
        for i in index:
            matcher = self._synced(rows[i])
            if matcher is None:  # after a draft the grammar refuses: the row is discarded
                continue
            if matcher.is_terminated():  # past the grammar's end (ignore_eos): stop tokens only
                only_stop.append(i)
            else:
                matcher.fill_next_token_bitmask(bitmask, i)
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=vocab,
                                        indices=index)
        for i in only_stop:
            keep = [t for t in rows[i].eos_token_ids if t < vocab]
            kept = logits[i, keep].clone()
            logits[i].fill_(float("-inf"))
            logits[i, keep] = kept

    def _synced(self, r: ScheduledRequest) -> Any | None:
        spec = r.sampling_params.structured_outputs
        history = r.history_token_ids
        if history is None:
            raise ValueError(f"request {r.request_id}: structured outputs need history_token_ids")
        output = history[len(history) - r.num_output_tokens:] if r.num_output_tokens else []
        tracked = self._tracked.get(r.request_id)
        if tracked is None or tracked.key != spec.key():
            tracked = self._track(r)
        accepted = tracked.accepted
        common = len(accepted)
        if output[:common] != accepted:  # usually the output only grew
            common = _common_prefix(accepted, output)
        if len(accepted) - common > MAX_ROLLBACK_TOKENS:
            tracked = self._track(r)
            accepted, common = tracked.accepted, 0
        elif len(accepted) > common:
            undo = len(accepted) - common
            undo_past_end = min(undo, tracked.past_end)
            tracked.past_end -= undo_past_end
            if undo > undo_past_end:
                tracked.matcher.rollback(undo - undo_past_end)
            del accepted[common:]
        for token in output[common:]:
            if token in r.eos_token_ids and tracked.matcher.is_terminated():
                tracked.past_end += 1
            elif not tracked.matcher.accept_token(token):
                if r.num_draft_tokens:  # a draft the grammar refuses: the target rejects it
                    return None
                raise RequestFault([r.request_id], f"output token {token} is not allowed by "
                                   "the request's structured output grammar")
            accepted.append(token)
        return tracked.matcher

    def _track(self, r: ScheduledRequest) -> _Tracked:
        spec = r.sampling_params.structured_outputs
        try:
            compiled = self.cache.get(spec)
        except ValueError as e:  # checked when the request was added; not this step's fault
            raise RequestFault([r.request_id], str(e)) from None
        tracked = _Tracked(spec.key(), compiled.matcher())
        self._tracked[r.request_id] = tracked
        return tracked


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((j for j in range(n) if a[j] != b[j]), n)
