"""`DisaggDecodeEngine`: an `LLMEngine` that also admits requests prefilled elsewhere.

    add_transferred_request  -> block ids to receive the prompt KV into (or None: no room yet)
    (the caller writes the KV into those blocks)
    admit_transferred        -> the request is a running decode from its next step
    abort_request            -> also frees the blocks of a transfer in progress

The request carries the prefill worker's first token, so its detokenizer, stop checks and
`max_tokens` continue exactly where the prefill worker stopped. n > 1 is not supported
(each choice would be a separate prefill).
"""
from __future__ import annotations

from deepinfer.core.request import Request
from deepinfer.core.scheduler_output import TokenLogprobs
from deepinfer.engine.detokenizer import IncrementalDetokenizer
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine.outputs import CompletionOutput, RequestMetrics
from deepinfer.engine.request_state import RequestState, SequenceState
from deepinfer.sampling_params import SamplingParams


class DisaggDecodeEngine(LLMEngine):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # The prefill worker's prefix hit per transferred request, kept until admission: the
        # scheduler counts the whole received prompt as cached, but usage must report what
        # the prefill worker reused (as colocated serving does).
        self._prefill_cached_tokens: dict[str, int] = {}

    def add_transferred_request(self, request_id: str, prompt_token_ids: list[int],
                                params: SamplingParams, arrival_time: float,
                                first_token_id: int,
                                first_logprob: TokenLogprobs | None,
                                num_cached_tokens: int = 0) -> list[int] | None:
        """Allocate blocks for the prompt KV of a prefilled request; None when the cache has
        no room now (nothing is recorded; retry later). Raises ValueError for bad input."""
        if params.n != 1:
            raise ValueError("disaggregated serving supports n=1 only")
        if self.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_token_ids, params = self.check_request(prompt_token_ids, params)
        request = Request(request_id, list(prompt_token_ids), params, arrival_time,
                          self.eos_token_ids)
        request.append_output_token(first_token_id)
        block_ids = self.scheduler.allocate_for_transfer(request)
        if block_ids is None:
            return None
        metrics = RequestMetrics(arrival_time)
        state = RequestState(request_id, list(prompt_token_ids), params, metrics)
        detok = IncrementalDetokenizer.for_request(self.tokenizer, prompt_token_ids, params)
        detok.add_tokens([first_token_id])
        output = CompletionOutput(0, detok.text, [first_token_id],
                                  logprobs=[] if params.logprobs is not None else None,
                                  cumulative_logprob=0.0 if params.logprobs is not None else None)
        if first_logprob is not None and output.logprobs is not None:
            output.logprobs.append(first_logprob)
            output.cumulative_logprob += first_logprob.logprob
        state.sequences[request_id] = SequenceState(0, detok, output)
        state.num_cached_tokens = num_cached_tokens  # the prefill worker's prefix hit
        self.adopt_request_state(state)
        self._prefill_cached_tokens[request_id] = num_cached_tokens
        return block_ids

    def admit_transferred(self, request_id: str) -> None:
        request = self.scheduler.admit_transferred(request_id)
        request.num_cached_tokens = self._prefill_cached_tokens.pop(request_id, 0)

    def abort_request(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._prefill_cached_tokens.pop(request_id, None)
        super().abort_request(request_ids)

    def has_schedulable_requests(self) -> bool:
        """Work for `step()` (transfers in progress are not)."""
        return self.scheduler.has_unfinished_requests()
