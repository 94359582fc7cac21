"""Data-only messages between scheduler and model runner. Pure."""
from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.sampling_params import SamplingParams


@dataclass(frozen=True)
class ScheduledRequest:
    """Work for one request in one step: compute KV for `token_ids` at positions
    [num_computed_tokens, num_computed_tokens + len(token_ids)); sample a token afterwards
    iff `sample` (the chunk reaches the end of the known tokens).

    Speculative decoding: the last `num_draft_tokens` of `token_ids` are draft tokens (not yet
    part of the request) after its last known token; the runner verifies them and samples
    from every one of the 1 + num_draft_tokens positions."""

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]
    sample: bool
    sampling_params: SamplingParams
    num_output_tokens: int  # tokens generated so far (for min_tokens / seeds)
    eos_token_ids: tuple[int, ...] = ()
    num_draft_tokens: int = 0
    # Prompt + output tokens before the sampled position, for requests whose sampling reads
    # them (penalties: SamplingParams.uses_history); None otherwise. The last
    # `num_output_tokens` are the output.
    history_token_ids: list[int] | None = None
    # Prompt log-probs (SamplingParams.prompt_logprobs): the prompt tokens that rows 0, 1, ...
    # of this chunk predict (row j, position num_computed_tokens + j, predicts the prompt
    # token at position num_computed_tokens + j + 1); None when none are asked for.
    prompt_logprob_token_ids: list[int] | None = None

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def draft_token_ids(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - self.num_draft_tokens:]

    @property
    def context_len(self) -> int:
        return self.num_computed_tokens + len(self.token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    preempted_request_ids: list[str] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)  # runner may drop their state
    predicted_step_time_s: float | None = None

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probability of the sampled token and the top-k alternatives at that step."""

    token_id: int
    logprob: float
    rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass(frozen=True)
class PromptLogprobsChunk:
    """Log-probs of the prompt tokens at positions `first_position`, `first_position + 1`,
    ... (one per entry of `logprobs`), computed in one prefill chunk."""

    first_position: int
    logprobs: list[TokenLogprobs]


@dataclass
class StepResult:
    """What the runner returns for one SchedulerOutput.

    A request that verified draft tokens is in `verified_token_ids` instead of
    `sampled_token_ids`: its accepted drafts, then the token the target sampled after them
    (a correction or a bonus token), with their log-probs in `verified_logprobs`. Chunks of
    requests that ask for prompt log-probs have them in `prompt_logprobs`."""

    sampled_token_ids: dict[str, int]
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    step_time_s: float = 0.0
    verified_token_ids: dict[str, list[int]] = field(default_factory=dict)
    verified_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)


@dataclass(frozen=True)
class Logprob:
    """vLLM's Logprob: a token's log-probability at one position, its rank there (1 = the
    most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's prompt log-probs: None for the first prompt token (nothing predicts it), then per
# prompt token {token id: Logprob} with the top-k alternatives and the prompt token itself.
PromptLogprobs = list[dict[int, Logprob] | None]
