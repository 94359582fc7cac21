"""Drafting with DeepSeek-V3's multi-token-prediction layer (method "mtp").

The MTP layer at position p reads the target's final hidden state h_p and token t_{p+1}, and
predicts t_{p+2}; it has its own one-layer latent KV cache (same block ids as the target).
The verifier hands it every step's hidden states (`observe`); after the step it runs the rows
p of the positions the target computed and accepted (catch-up; the last one, with the newest
token, gives the first draft), then feeds each draft back with its own output hidden state
for the next one. Positions the target did not compute in this request (a prefix-cache hit,
KV received from a prefill worker) keep whatever MTP KV their blocks hold: that only lowers
acceptance, never changes the output.
"""
from __future__ import annotations

import torch
from torch import Tensor

from deepinfer.core.scheduler_output import ScheduledRequest
from deepinfer.spec.draft_model import RunnerDrafter
from deepinfer.spec.draft_runner import DraftRunner
from deepinfer.spec.drafter import DraftRequest


class MTPDrafter(RunnerDrafter):
    def __init__(self, runner: DraftRunner, num_speculative_tokens: int, vocab_size: int) -> None:
        super().__init__(runner, num_speculative_tokens, vocab_size)  # MTP rows: num_computed
        self._hidden: Tensor | None = None  # the last target step's [T, hidden]
        self._rows: dict[str, tuple[int, int]] = {}  # request -> (first row, its first position)

    def observe(self, hidden: Tensor, ordered: list[ScheduledRequest]) -> None:
        """The target step's final hidden states, requests laid out in `ordered` order."""
        self._hidden = hidden
        self._rows = {}
        offset = 0
        for r in ordered:
            self._rows[r.request_id] = (offset, r.num_computed_tokens)
            offset += r.num_new_tokens

    def num_drafts(self, r: DraftRequest) -> int:
        """Draft j (1-based) after the first is fed at position num_tokens - 3 + j."""
        if not r.is_decode:
            return 0
        capacity = len(r.block_ids) * self.runner.block_size
        return max(0, min(self.k, r.max_num_drafts, capacity - r.num_tokens + 2))

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> dict[str, list[int]]:
        catch_up: list[ScheduledRequest] = []
        inputs: list[Tensor] = []
        drafting: dict[str, tuple[DraftRequest, int]] = {}
        for r in requests:
            if r.request_id not in self._rows or self._hidden is None:
                continue
            first_row, step_start = self._rows[r.request_id]
            start = max(self.num_computed.get(r.request_id, step_start), step_start)
            end = r.num_computed_tokens  # rows p < end: h_p and t_{p+1} are known
            m = self.num_drafts(r)
            self.num_computed[r.request_id] = end
            if end <= start:
                continue
            catch_up.append(ScheduledRequest(
                r.request_id, r.token_ids[start + 1:end + 1], start, r.block_ids, sample=m > 0,
                sampling_params=r.sampling_params, num_output_tokens=r.num_output_tokens))
            lo = first_row + start - step_start
            inputs.append(self._hidden[lo:lo + end - start])
            if m:
                drafting[r.request_id] = (r, m)
        self._hidden, self._rows = None, {}
        if not catch_up:
            return {}
        last = self.runner.forward(catch_up, inputs)  # [N, hidden], MTP outputs
        sample_rows = [i for i, s in enumerate(catch_up) if s.sample]
        if not sample_rows:
            return {}
        rows = [catch_up[i] for i in sample_rows]
        prev = {s.request_id: last[i:i + 1] for i, s in zip(sample_rows, rows)}
        tokens, probs = self.runner.sample_drafts(
            self.runner.model.compute_logits(last[sample_rows]), rows, self.vocab_size)
        drafts = {s.request_id: [t] for s, t in zip(rows, tokens)}
        qs = {s.request_id: [q] for s, q in zip(rows, probs)}
        for j in range(1, max(m for _, m in drafting.values())):
            step = [ScheduledRequest(
                rid, [drafts[rid][-1]], r.num_tokens - 2 + j, r.block_ids, sample=True,
                sampling_params=r.sampling_params, num_output_tokens=r.num_output_tokens + j)
                for rid, (r, m) in drafting.items() if m > j]
            if not step:
                break
            out = self.runner.forward(step, [prev[s.request_id] for s in step])
            tokens, probs = self.runner.sample_drafts(self.runner.model.compute_logits(out), step,
                                                      self.vocab_size)
            for i, (s, t, q) in enumerate(zip(step, tokens, probs)):
                drafts[s.request_id].append(t)
                qs[s.request_id].append(q)
                prev[s.request_id] = out[i:i + 1]
        for rid, token_ids in drafts.items():
            self.probs.put(rid, token_ids, qs[rid])
        return drafts
