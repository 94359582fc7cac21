"""Request state as the scheduler sees it: token counts, status, block hashes. Pure."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from deepinfer.core.prefix_hash import BlockHash, ImageSpan
from deepinfer.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)

    @property
    def finish_reason(self) -> str | None:
        return {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                RequestStatus.FINISHED_ABORTED: "abort"}.get(self)


@dataclass
class Request:
    """One sequence. `all_token_ids` = prompt + generated; the scheduler advances
    `num_computed_tokens` (tokens whose KV is in the cache) towards `num_tokens`."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int | None = None

    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None  # prefix-cache hit at first schedule
    num_preemptions: int = 0
    block_hashes: list[BlockHash] = field(default_factory=list)
    stop_token_id: int | None = None  # the token that stopped it, if any
    # Speculative decoding: draft tokens proposed after the last step, verified in the next
    # one. Never part of `all_token_ids` (so never hashed into the prefix cache).
    spec_token_ids: list[int] = field(default_factory=list)
    # Image placeholders in the prompt (sorted by offset): hashed into the overlapping blocks.
    mm_placeholders: list[ImageSpan] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        self.all_token_ids: list[int] = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt log-probs are asked for and not all computed yet (nothing is sampled yet, so
        this holds again after a preemption mid-prompt). Such a prompt is computed, never
        taken from the prefix cache: a cached block has no logits."""
        return self.sampling_params.prompt_logprobs is not None and not self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def max_total_tokens(self) -> int:
        """Upper bound on prompt + output, used for reservations and length checks."""
        limit = self.num_prompt_tokens + (self.sampling_params.max_tokens or 0)
        if self.sampling_params.max_tokens is None and self.max_model_len is not None:
            limit = self.max_model_len
        if self.max_model_len is not None:
            limit = min(limit, self.max_model_len)
        return limit
