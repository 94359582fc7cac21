"""Speculative decoding counters, as vLLM names them (`spec_decode_num_*`). Pure.

A *draft* is one verification of a request's draft tokens in one step. Acceptance length is
the tokens a verification emits: the accepted drafts plus the target's own token, so its
mean is 1 + num_accepted_tokens / num_drafts (1.0 = no speed-up).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [i]: verifications whose draft at position i (0-based) was accepted.
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        if not 0 <= num_accepted_tokens <= num_draft_tokens:
            raise ValueError(f"accepted {num_accepted_tokens} of {num_draft_tokens} drafts")
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        if len(per_pos) < num_draft_tokens:
            per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for i in range(num_accepted_tokens):
            per_pos[i] += 1

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens emitted per verification (None before the first one)."""
        if self.num_drafts == 0:
            return None
        return 1.0 + self.num_accepted_tokens / self.num_drafts

    @property
    def acceptance_rate(self) -> float | None:
        if self.num_draft_tokens == 0:
            return None
        return self.num_accepted_tokens / self.num_draft_tokens
