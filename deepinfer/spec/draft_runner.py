"""Running a drafter model (a draft LM or DeepSeek's MTP layer) on the runner machinery.

A drafter has its own paged KV cache with the target's block size and block count, and reads
it through the target's block tables: a request's draft KV for position p sits in the same
(block, slot) as its target KV. The drafter builds `ScheduledRequest`s itself (catch-up
chunks, then one token per draft step); `DraftRunner.forward` writes their KV and returns
each request's last hidden state. `sample_drafts` picks draft tokens: argmax for greedy
requests (q one-hot), else a sample from the drafter's own distribution q, which is kept for
rejection sampling.
"""
from __future__ import annotations

import torch
from torch import Tensor

from deepinfer.core.scheduler_output import ScheduledRequest
from deepinfer.runtime.model_runner import ModelRunner
from deepinfer.runtime.sampler import sampling_probs

DRAFT_STREAM = 0xD7AF7  # (seed ^ stream, position) seeds a drafter's sampling noise


class DraftRunner(ModelRunner):
    @torch.inference_mode()
    def forward(self, scheduled: list[ScheduledRequest],
                row_inputs: list[Tensor] | None = None) -> Tensor:
        """Run `scheduled` (KV written into this runner's cache) and return the hidden state
        of each one's last token, [N, hidden] in `scheduled` order. `row_inputs[i]`:
        per-token extra input of request i ([num_new_tokens, d], e.g. the target's hidden
        states for MTP), passed to the model as its fourth argument."""
        order = sorted(range(len(scheduled)), key=lambda i: not self._as_decode(scheduled[i]))
        ordered = [scheduled[i] for i in order]
        input_ids, positions, meta, _, _ = self._prepare(ordered)
        attn = self._attention_backend(meta)
        if row_inputs is None:
            hidden = self.model(input_ids, positions, attn)  # [T, hidden]
        else:
            extra = torch.cat([row_inputs[i] for i in order])  # [T, d]
            hidden = self.model(input_ids, positions, attn, extra)
        ends = torch.tensor([r.num_new_tokens for r in ordered], device=hidden.device).cumsum(0) - 1
        inverse = torch.empty(len(order), dtype=torch.long, device=hidden.device)
        inverse[torch.tensor(order, device=hidden.device)] = torch.arange(len(order), device=hidden.device)
        return hidden[ends][inverse]

    @torch.inference_mode()
    def sample_drafts(self, logits: Tensor, rows: list[ScheduledRequest], vocab_size: int
                      ) -> tuple[list[int], list[Tensor | None]]:
        """Draft token per row of `logits` [N, V_draft] (row i drafts output position
        rows[i].num_output_tokens), and q padded to the target's `vocab_size` for rows that
        sampled (None for greedy rows)."""
        tokens = logits.argmax(dim=-1)
        probs: list[Tensor | None] = [None] * len(rows)
        rand = [i for i, r in enumerate(rows) if not r.sampling_params.greedy]
        if rand:
            idx = torch.tensor(rand, device=logits.device)
            q = sampling_probs(logits[idx], [rows[i].sampling_params for i in rand])  # [n, V_draft]
            if q.shape[1] < vocab_size:
                q = torch.nn.functional.pad(q, (0, vocab_size - q.shape[1]))
            noise = self.sampler.exponential_noise([rows[i] for i in rand], q.shape[1], q.device,
                                                   stream=DRAFT_STREAM)
            tokens[idx] = (q / noise).argmax(dim=-1)
            for j, i in enumerate(rand):
                probs[i] = q[j]
        return tokens.tolist(), probs
