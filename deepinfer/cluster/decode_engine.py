"""`DisaggDecodeEngine`: an `LLMEngine` that also admits requests prefilled elsewhere.

    add_transferred_request  -> block ids to receive the prompt KV into (or None: no room yet)
    (the caller writes the KV into those blocks)
    admit_transferred        -> the request is a running decode from its next step
    abort_request            -> also frees the blocks of a transfer in progress

The request carries the prefill worker's first token, so its detokenizer, stop checks and
`max_tokens` continue exactly where the prefill worker stopped. n > 1 is not supported
(each choice would be a separate prefill).

Requests with images carry their placeholders (`mm_inputs`, no pixels): the block hashes
include them as on the prefill worker, and if the request is preempted and recomputed here,
the image rows come from the embedding cache or its shared-store tier; where they are
nowhere the request fails with an error before the step (never recomputed without them).
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
        self._transfer_images: dict[str, tuple] = {}  # request id -> (RequestImages, mm_inputs)

    def add_transferred_request(self, request_id: str, prompt_token_ids: list[int],
                                params: SamplingParams, arrival_time: float,
                                first_token_id: int,
                                first_logprob: TokenLogprobs | None,
                                num_cached_tokens: int = 0,
                                mm_inputs=None) -> list[int] | None:
        """Allocate blocks for the prompt KV of a prefilled request; None when the cache has
        no room now (nothing is recorded; retry later). Raises ValueError for bad input."""
        if params.n != 1:
            raise ValueError("disaggregated serving supports n=1 only")
        if self.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_token_ids, params = self.check_request(prompt_token_ids, params)
        images = self._check_transfer_images(prompt_token_ids, mm_inputs)
        request = Request(request_id, list(prompt_token_ids), params, arrival_time,
                          self.eos_token_ids)
        if images is not None:
            request.mm_placeholders = list(mm_inputs.placeholders)  # hashes as on prefill
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
        if images is not None:
            self._transfer_images[request_id] = (images, mm_inputs)
        return block_ids

    def _check_transfer_images(self, prompt_token_ids: list[int], mm_inputs):
        if mm_inputs is None or not mm_inputs.placeholders or self.mm_images is None:
            return self._check_images(prompt_token_ids, mm_inputs)  # the usual refusals
        return self.mm_images.check(prompt_token_ids, mm_inputs, require_embeddings=False)

    def admit_transferred(self, request_id: str) -> None:
        request = self.scheduler.admit_transferred(request_id)
        request.num_cached_tokens = self._prefill_cached_tokens.pop(request_id, 0)
        images = self._transfer_images.pop(request_id, None)
        if images is not None:  # held from now on (a transfer is not a live request yet)
            self.mm_images.add([request_id], *images)

    def abort_request(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._prefill_cached_tokens.pop(request_id, None)
            self._transfer_images.pop(request_id, None)
        super().abort_request(request_ids)

    def step(self):
        self._fetch_recompute_images()
        return super().step()

    def _fetch_recompute_images(self) -> None:
        """Preempted requests wait to be recomputed: give each the embeddings of its images
        (cache, then store) or fail it now, with an error, rather than mid-step."""
        if self.mm_images is None:
            return
        for request in list(self.scheduler.waiting):
            missing = self.mm_images.fetch_missing(request.request_id)
            if missing:
                self._fail(request.request_id,
                           f"this request was preempted on its decode worker and must be "
                           f"recomputed, but the embeddings of {len(missing)} image(s) are not in "
                           f"its embedding cache or the shared store (image {missing[0][:12]}...); "
                           f"send the request again")

    def has_schedulable_requests(self) -> bool:
        """Work for `step()` (transfers in progress are not)."""
        return self.scheduler.has_unfinished_requests()
