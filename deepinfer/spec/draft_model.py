"""Drafting with a smaller model that shares the target's tokenizer (method "draft_model").

The draft model keeps its own paged KV cache (same block ids as the target). Per request it
remembers how many positions of that cache are valid; after each engine step it first runs
the tokens the target accepted since then (a chunk: the catch-up, ending with the newest
token when the request decodes), whose last logits give the first draft, then one forward
per further draft. Draft KV past the accepted tokens is simply overwritten later. A request
seen for the first time (new, resumed after preemption, or received from a prefill worker)
catches up from position 0, so its draft KV never depends on what another request left in a
shared prefix block.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from deepinfer.core.scheduler_output import ScheduledRequest
from deepinfer.spec.draft_runner import DraftRunner
from deepinfer.spec.drafter import DraftRequest


class DraftProbs:
    """The q each request's latest drafts were sampled from (only requests that sampled)."""

    def __init__(self) -> None:
        self._probs: dict[str, tuple[list[int], Tensor]] = {}

    def put(self, request_id: str, token_ids: list[int], probs: list[Tensor | None]) -> None:
        if probs and probs[0] is not None:
            self._probs[request_id] = (token_ids, torch.stack(probs))  # [k, V]
        else:
            self._probs.pop(request_id, None)

    def take(self, request_id: str, draft_token_ids: list[int]) -> Tensor | None:
        entry = self._probs.pop(request_id, None)
        if entry is None:
            return None
        token_ids, probs = entry
        n = len(draft_token_ids)
        if token_ids[:n] != list(draft_token_ids):
            raise RuntimeError(f"request {request_id!r}: verifying drafts {draft_token_ids} "
                               f"that were not proposed ({token_ids})")
        return probs[:n]

    def remove(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._probs.pop(request_id, None)


class RunnerDrafter:
    """What drafters that run a model (draft model, MTP) share: their runner, the positions
    their own KV is valid below, and the q of the drafts they sampled."""

    def __init__(self, runner: DraftRunner, num_speculative_tokens: int, vocab_size: int) -> None:
        self.runner = runner
        self.k = num_speculative_tokens
        self.vocab_size = vocab_size  # the target's (q is padded to it)
        self.num_computed: dict[str, int] = {}  # drafter KV valid below this position
        self.probs = DraftProbs()

    def remove(self, request_ids: Iterable[str]) -> None:
        request_ids = list(request_ids)
        for request_id in request_ids:
            self.num_computed.pop(request_id, None)
        self.probs.remove(request_ids)

    def take_draft_probs(self, request_id: str, draft_token_ids: list[int]) -> Tensor | None:
        return self.probs.take(request_id, draft_token_ids)


class DraftModelDrafter(RunnerDrafter):

    def num_drafts(self, r: DraftRequest) -> int:
        """Drafts for `r`: draft j (1-based) is fed at position num_tokens - 1 + j, which
        must lie in its allocated blocks (the scheduler's lookahead slots)."""
        if not r.is_decode:
            return 0
        capacity = len(r.block_ids) * self.runner.block_size
        return max(0, min(self.k, r.max_num_drafts, capacity - r.num_tokens + 1))

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> dict[str, list[int]]:
        catch_up: list[ScheduledRequest] = []
        drafting: list[tuple[DraftRequest, int]] = []
        for r in requests:
            m = self.num_drafts(r)
            end = r.num_tokens if m else r.num_computed_tokens
            start = self.num_computed.get(r.request_id, 0)
            if start > end:
                start = 0  # cannot happen without a missed preemption: recompute
            self.num_computed[r.request_id] = end
            if end > start:
                catch_up.append(ScheduledRequest(
                    r.request_id, r.token_ids[start:end], start, r.block_ids, sample=m > 0,
                    sampling_params=r.sampling_params, num_output_tokens=r.num_output_tokens))
            if m:
                drafting.append((r, m))
        if not catch_up:
            return {}
        last = self.runner.forward(catch_up)  # [N, hidden]
        sample_rows = [i for i, s in enumerate(catch_up) if s.sample]
        if not sample_rows:
            return {}
        rows = [catch_up[i] for i in sample_rows]
        logits = self.runner.model.compute_logits(last[sample_rows])
        tokens, probs = self.runner.sample_drafts(logits, rows, self.vocab_size)
        drafts = {r.request_id: [t] for r, t in zip(rows, tokens)}
        qs = {r.request_id: [q] for r, q in zip(rows, probs)}
        by_id = dict((r.request_id, (r, m)) for r, m in drafting)
        for j in range(1, max(m for _, m in drafting)):
            step = [ScheduledRequest(
                rid, [drafts[rid][-1]], by_id[rid][0].num_tokens - 1 + j, by_id[rid][0].block_ids,
                sample=True, sampling_params=by_id[rid][0].sampling_params,
                num_output_tokens=by_id[rid][0].num_output_tokens + j)
                for rid in drafts if by_id[rid][1] > j]
            if not step:
                break
            logits = self.runner.model.compute_logits(self.runner.forward(step))
            tokens, probs = self.runner.sample_drafts(logits, step, self.vocab_size)
            for s, t, q in zip(step, tokens, probs):
                drafts[s.request_id].append(t)
                qs[s.request_id].append(q)
        for rid, token_ids in drafts.items():
            self.probs.put(rid, token_ids, qs[rid])
        return drafts
