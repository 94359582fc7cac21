"""The drafter interface: after each engine step, propose draft tokens per running request. Pure.

The engine calls `propose` once per step with every request the step computed tokens for (so
drafters with their own KV cache or the target's hidden states can keep up, even mid-prefill)
and `remove` for requests that finished or were preempted. Drafts are verified in the next
step; a drafter that *samples* its drafts (rather than taking its argmax) returns the
distributions it sampled from through `take_draft_probs`, so the verifier can apply
rejection sampling with the right q.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from deepinfer.sampling_params import SamplingParams


@dataclass(frozen=True)
class DraftRequest:
    """One request after a step. `token_ids` is the request's prompt + output (read only);
    the target's KV holds its first `num_computed_tokens`, of which the last
    `num_step_tokens` were computed (and accepted) in the step just run. When it is a decode
    (`num_computed_tokens == len(token_ids) - 1`) it may get up to `max_num_drafts` drafts."""

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    num_step_tokens: int
    block_ids: list[int]
    sampling_params: SamplingParams
    num_output_tokens: int
    max_num_drafts: int

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        return self.num_computed_tokens == len(self.token_ids) - 1


class Drafter(Protocol):
    def propose(self, requests: list[DraftRequest]) -> dict[str, list[int]]:
        """Draft tokens for the decodes among `requests` (absent or [] = none)."""

    def remove(self, request_ids: Iterable[str]) -> None:
        """Forget per-request state (finished, aborted or preempted requests)."""

    def take_draft_probs(self, request_id: str, draft_token_ids: list[int]) -> Any | None:
        """The [len(draft_token_ids), vocab] distributions the drafts were sampled from, or
        None when they were chosen deterministically (q one-hot)."""
