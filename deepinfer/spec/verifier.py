"""The model runner's sampling step when speculative decoding is on.

Every request that samples gets one logits row per position it samples: one for a plain
decode or a prompt's last chunk, 1 + k for a verification of k drafts (its last known token
and each draft; row j predicts output position num_output_tokens + j). Rows are sampled as
independent positions (their own (seed, position) noise and min_tokens mask); then each
verification keeps the longest run of drafts the target accepts and emits the target's token
after it (see rejection_sampler). A drafter that sampled its drafts supplies q.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import Tensor

from deepinfer.core.scheduler_output import ScheduledRequest, StepResult
from deepinfer.runtime.sampler import Sampler, sampling_probs
from deepinfer.spec.drafter import Drafter
from deepinfer.spec.rejection_sampler import num_matching, rejection_sample

ACCEPT_STREAM = 0x5EC0ACCE  # (seed ^ stream, position) seeds the acceptance uniforms

# Called with the step's hidden states [T, hidden] and the scheduled requests in row order.
HiddenObserver = Callable[[Tensor, list[ScheduledRequest]], None]


@dataclasses.dataclass
class _Group:
    request: ScheduledRequest
    first_row: int  # index of its first logits row

    @property
    def num_rows(self) -> int:
        return 1 + self.request.num_draft_tokens


def _position_row(r: ScheduledRequest, j: int) -> ScheduledRequest:
    """Row j of a verification: output position num_output_tokens + j, after drafts [:j]
    (the tokens a penalty at that position counts when those drafts are accepted)."""
    history = r.history_token_ids
    return dataclasses.replace(
        r, num_output_tokens=r.num_output_tokens + j,
        history_token_ids=None if history is None else history + r.draft_token_ids[:j])


class SpecVerifier:
    def __init__(self, sampler: Sampler, drafter: Drafter,
                 on_hidden: HiddenObserver | None = None) -> None:
        self.sampler = sampler
        self.drafter = drafter
        self.on_hidden = on_hidden

    def sample(self, model, hidden: Tensor, ordered: list[ScheduledRequest]) -> StepResult:
        """`hidden` [T, hidden]: the step's final hidden states, requests laid out in
        `ordered` order, each over its `num_new_tokens` rows."""
        if self.on_hidden is not None:
            self.on_hidden(hidden, ordered)
        groups, rows, flat_rows = self._rows(ordered)
        result = StepResult({})
        if not rows:
            return result
        index = torch.tensor(flat_rows, dtype=torch.long, device=hidden.device)
        logits = model.compute_logits(hidden[index])  # [R, vocab] fp32
        raw = self.sampler.keep_raw(logits, rows)  # raw logprobs modes: before processing
        self.sampler.process_logits(logits, rows, self.sampler.grammar)
        tokens = self._sample(logits, rows, groups)
        lp_rows = [g.first_row + j for g in groups for j in range(len(tokens[id(g)]))]
        lp_reqs = [rows[i] for i in lp_rows]
        lp_tokens = [t for g in groups for t in tokens[id(g)]]
        logprobs = self.sampler.row_logprobs(logits[lp_rows], lp_reqs, lp_tokens,
                                             None if raw is None else raw.take(lp_rows)) \
            if any(r.sampling_params.logprobs is not None for r in lp_reqs) else [None] * len(lp_rows)
        pos = 0
        for g in groups:
            rid, emitted = g.request.request_id, tokens[id(g)]
            lps = logprobs[pos:pos + len(emitted)]
            pos += len(emitted)
            if g.request.num_draft_tokens == 0:
                result.sampled_token_ids[rid] = emitted[0]
                if lps[0] is not None:
                    result.logprobs[rid] = lps[0]
            else:
                result.verified_token_ids[rid] = emitted
                if lps and lps[0] is not None:
                    result.verified_logprobs[rid] = list(lps)
        return result

    @staticmethod
    def _rows(ordered: list[ScheduledRequest]
              ) -> tuple[list[_Group], list[ScheduledRequest], list[int]]:
        groups: list[_Group] = []
        rows: list[ScheduledRequest] = []  # one per logits row, at its own output position
        flat_rows: list[int] = []  # row of `hidden`
        offset = 0
        for r in ordered:
            end = offset + r.num_new_tokens
            if r.sample:
                group = _Group(r, len(rows))
                groups.append(group)
                flat_rows.extend(range(end - group.num_rows, end))
                rows.extend(r if j == 0 else _position_row(r, j) for j in range(group.num_rows))
            offset = end
        return groups, rows, flat_rows

    def _sample(self, logits: Tensor, rows: list[ScheduledRequest], groups: list[_Group]
                ) -> dict[int, list[int]]:
        """Emitted tokens per group (keyed by id(group))."""
        with_q: dict[int, Tensor] = {}
        for g in groups:
            r = g.request
            if r.num_draft_tokens and not r.sampling_params.greedy:
                q = self.drafter.take_draft_probs(r.request_id, r.draft_token_ids)
                if q is not None:
                    with_q[id(g)] = q
        plain = [i for g in groups if id(g) not in with_q
                 for i in range(g.first_row, g.first_row + g.num_rows)]
        target: dict[int, int] = {}
        if len(plain) == len(rows):  # no drafter q: every row, in order (no [R, V] copy)
            target = dict(enumerate(self.sampler.sample_tokens(logits, rows).tolist()))
        elif plain:
            index = torch.tensor(plain, dtype=torch.long, device=logits.device)
            sampled = self.sampler.sample_tokens(logits[index], [rows[i] for i in plain]).tolist()
            target = dict(zip(plain, sampled))
        out: dict[int, list[int]] = {}
        for g in groups:
            if id(g) in with_q:
                out[id(g)] = self._rejection(logits, rows, g, with_q[id(g)])
                continue
            own = [target[i] for i in range(g.first_row, g.first_row + g.num_rows)]
            num_accepted = num_matching(own, g.request.draft_token_ids)
            out[id(g)] = own[:num_accepted + 1]
        return out

    def _rejection(self, logits: Tensor, rows: list[ScheduledRequest], g: _Group,
                   draft_probs: Tensor) -> list[int]:
        group_rows = rows[g.first_row:g.first_row + g.num_rows]
        p = sampling_probs(logits[g.first_row:g.first_row + g.num_rows],
                           [r.sampling_params for r in group_rows])  # [k + 1, V]
        noise = self.sampler.exponential_noise(group_rows, p.shape[1], p.device)
        uniforms = self._uniforms(group_rows[:-1], p.device)
        return rejection_sample(p, draft_probs.to(p.device, p.dtype), g.request.draft_token_ids,
                                uniforms, noise)

    def _uniforms(self, rows: list[ScheduledRequest], device: torch.device) -> Tensor:
        out = torch.empty(len(rows), device=device)
        for j, r in enumerate(rows):
            seed = r.sampling_params.seed
            generator = self.sampler.default_generator if seed is None else \
                self.sampler.seed_position(seed ^ ACCEPT_STREAM, r.num_output_tokens)
            out[j:j + 1].uniform_(generator=generator)
        return out
