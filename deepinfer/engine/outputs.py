"""What the engine returns to callers (vLLM-shaped)."""
from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.core.scheduler_output import Logprob, PromptLogprobs, TokenLogprobs


def prompt_logprob_entry(lp: TokenLogprobs, token_text) -> dict[int, Logprob]:
    """One position's vLLM-shaped entry; `token_text(token_id)` gives a token's text."""
    entry = {t: Logprob(v, i + 1, token_text(t))
             for i, (t, v) in enumerate(zip(lp.top_token_ids, lp.top_logprobs))}
    entry[lp.token_id] = Logprob(lp.logprob, lp.rank, token_text(lp.token_id))
    return entry


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """time.monotonic() seconds."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    prompt: str | None = None
    # SamplingParams.prompt_logprobs: set once the prompt is computed (shared, do not modify)
    prompt_logprobs: PromptLogprobs | None = None


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_kv_blocks_used: int = 0
    num_kv_blocks_total: int = 0
    prefix_cache_queries: int = 0  # tokens looked up
    prefix_cache_hits: int = 0  # tokens found
    num_preemptions: int = 0
    num_steps: int = 0
    step_time_s: float = 0.0  # last step
    predicted_step_time_s: float | None = None  # last step, when the scheduler predicts
    # Cost-model accuracy over the steps that had a prediction: sum of |pred - meas| / meas.
    prediction_abs_error_sum: float = 0.0
    num_predicted_steps: int = 0
    extra: dict = field(default_factory=dict)
    # Speculative decoding (vLLM's spec_decode_* counters; see core.spec_decode_stats)
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    @property
    def spec_decode_mean_acceptance_length(self) -> float | None:
        """Tokens emitted per verification: 1 + accepted / drafts (None before any)."""
        if not self.spec_decode_num_drafts:
            return None
        return 1.0 + self.spec_decode_num_accepted_tokens / self.spec_decode_num_drafts
