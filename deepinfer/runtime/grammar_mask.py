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

import torch
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
        self._bitmask: Tensor | None = None  # host rows reused step to step (_bitmask_rows)
        self._stop_index: dict[tuple, Tensor] = {}  # (stop ids, V, device) -> ids to keep
        # Work counters (tests, profiles): matcher fills, rows past the end, host bitmasks made.
        self.num_fills = 0
        self.num_stop_rows = 0
        self.num_bitmask_allocations = 0

    def __len__(self) -> int:
        return len(self._tracked)

    def forget(self, request_ids) -> None:
        for request_id in request_ids:
            self._tracked.pop(request_id, None)

    def apply(self, logits: Tensor, rows: list[ScheduledRequest]) -> None:
        """Mask, in place, the logits [N, V] of the rows with structured outputs: one bitmask
        kernel over the rows inside their grammar, and for the rows past its end (ignore_eos:
        stop tokens only, no matcher to ask) one fill of all of them at once."""
        index = [i for i, r in enumerate(rows) if r.sampling_params.structured_outputs is not None]
        if not index:
            return
        vocab = logits.shape[1]
        bitmask = None
        live: list[int] = []
        past_end: dict[tuple, list[int]] = {}  # stop ids -> rows
        for i in index:
            matcher = self._synced(rows[i])
            if matcher is None:  # after a draft the grammar refuses: the row is discarded
                continue
            if matcher.is_terminated():
                past_end.setdefault(tuple(rows[i].eos_token_ids), []).append(i)
                continue
            if bitmask is None:
                bitmask = self._bitmask_rows(len(rows), vocab, logits.device)
            matcher.fill_next_token_bitmask(bitmask, i)  # the whole row: nothing stale stays
            live.append(i)
        self.num_fills += len(live)
        if live:
            xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=vocab,
                                            indices=live)
        for stop_ids, stop_rows in past_end.items():
            self._keep_only(logits, stop_rows, stop_ids)
            self.num_stop_rows += len(stop_rows)

    def _keep_only(self, logits: Tensor, row_ids: list[int], stop_ids: tuple) -> None:
        """Rows `row_ids` of `logits` to -inf but at the stop tokens below V (kept as they
        are): three ops for all the rows, whatever their number."""
        device, vocab = logits.device, logits.shape[1]
        key = (stop_ids, vocab, device)
        keep = self._stop_index.get(key)
        if keep is None:
            keep = torch.tensor(sorted({t for t in stop_ids if 0 <= t < vocab}),
                                dtype=torch.long, device=device)
            self._stop_index[key] = keep
        rows_t = torch.tensor(row_ids, dtype=torch.long, device=device)
        kept = logits[rows_t.unsqueeze(1), keep]  # [rows, stop ids]
        logits.index_fill_(0, rows_t, float("-inf"))
        logits[rows_t.unsqueeze(1), keep] = kept

    def _bitmask_rows(self, num_rows: int, vocab: int, device) -> Tensor:
        """The first `num_rows` rows of a host bitmask kept across steps (grown, never
        shrunk; pinned for a CUDA step so the copy up is a direct one)."""
        words = (vocab + 31) // 32
        buf = self._bitmask
        if buf is None or buf.shape[1] != words or buf.shape[0] < num_rows:
            rows = max(num_rows, 0 if buf is None or buf.shape[1] != words else 2 * buf.shape[0])
            buf = torch.empty(rows, words, dtype=torch.int32,
                              pin_memory=device.type == "cuda")
            self._bitmask = buf
            self.num_bitmask_allocations += 1
        return buf[:num_rows]

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
