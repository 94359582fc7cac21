"""What both OpenAI endpoints share: model check, limits, SamplingParams, one engine request.

The endpoint classes (`serving_completion`, `serving_chat`) turn a validated pydantic request
into one or more engine requests with `submit()`, then shape the accumulated choices into
OpenAI responses or SSE chunks.
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pydantic import BaseModel

from deepinfer.core.scheduler_output import TokenLogprobs
from deepinfer.invalid_parameter import InvalidParameter
from deepinfer.sampling_params import SamplingParams
from deepinfer.engine.exceptions import EngineDeadError, RequestFailedError
from deepinfer.server.admission import Admission, AdmissionGate
from deepinfer.server.errors import APIError, bad_request
from deepinfer.wire.engine_messages import ChoiceDelta, RequestDelta
from deepinfer.server.metrics import ServerMetrics
from deepinfer.server.protocol import UNSUPPORTED_FIELDS, PromptTokensDetails, UsageInfo
from deepinfer.server.structured_request import structured_outputs_for

logger = logging.getLogger(__name__)
# Unknown request fields already logged (once per name per process: clients send the same
# extras with every request); capped, so random names cannot grow it without bound.
_logged_unknown_fields: set[str] = set()
_MAX_LOGGED_UNKNOWN_FIELDS = 256


@dataclass
class ChoiceState:
    """Accumulated output of one choice."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def apply(self, delta: ChoiceDelta) -> None:
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason


@dataclass
class EngineRequestState:
    """One engine request (one prompt, `n` choices) as the front accumulates it."""

    request_id: str
    prompt_token_ids: list[int]
    choices: list[ChoiceState]
    num_cached_tokens: int = 0
    finished: bool = False
    prompt_logprobs: list | None = None  # core.scheduler_output.PromptLogprobs, once computed

    def apply(self, delta: RequestDelta) -> None:
        self.num_cached_tokens = delta.num_cached_tokens
        self.finished = delta.finished
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        for choice_delta in delta.choices:
            self.choices[choice_delta.index].apply(choice_delta)


@dataclass(frozen=True)
class NewOutput:
    """Where the unsent part of a choice starts."""

    token_start: int
    char_start: int
    is_first: bool


@dataclass
class StreamCursor:
    """How much of one choice a stream has sent; `advance` says what to send next."""

    num_tokens: int = 0
    num_chars: int = 0
    started: bool = False
    done: bool = False
    # Where the next token's text starts, summed over the tokens' own texts (logprobs'
    # text_offset): `num_chars` lags behind while text is held back for a stop string or an
    # incomplete character, so offsets counted from it would be wrong.
    token_text_offset: int = 0

    def advance(self, choice: ChoiceState) -> NewOutput | None:
        """None when there is nothing new (or the choice's final chunk was already sent)."""
        if self.done:
            return None
        finished = choice.finish_reason is not None
        if len(choice.token_ids) == self.num_tokens and not finished:
            return None
        new = NewOutput(self.num_tokens, self.num_chars, not self.started)
        self.num_tokens = len(choice.token_ids)
        self.num_chars = len(choice.text)
        self.started = True
        self.done = finished
        return new


def make_usage(states: list[EngineRequestState], prompt_tokens_details: bool = False) -> UsageInfo:
    """Token counts; the cached-token count only when the server was started with
    --enable-prompt-tokens-details (as vLLM): it tells a client, block by block, whether
    anyone sent a prefix before, so it is not reported by default."""
    prompt = sum(len(s.prompt_token_ids) for s in states)
    completion = sum(len(c.token_ids) for s in states for c in s.choices)
    details = None
    if prompt_tokens_details:
        details = PromptTokensDetails(cached_tokens=sum(s.num_cached_tokens for s in states))
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion, prompt_tokens_details=details)


def sse_event(payload: BaseModel | dict) -> str:
    body = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {body}\n\n"


SSE_DONE = "data: [DONE]\n\n"


_MIN_TEMPERATURE = 1e-5  # below: greedy (a float32 division would overflow to inf / nan)
_MIN_TOP_P = 1e-7  # below: the same single top token, but still > 0 in float32
# A log-prob of -inf (a token the request's processing excluded; --logprobs-mode processed_*)
# has no JSON form: it is sent as this floor, as vLLM does.
LOGPROB_FLOOR = -9999.0


def json_logprob(value: float) -> float:
    return max(value, LOGPROB_FLOOR)



def _same_value(value, off) -> bool:
    """JSON equality that keeps booleans apart from numbers (0 == False in Python)."""
    if isinstance(off, bool) or isinstance(value, bool):
        return value is off
    if isinstance(off, (int, float)):
        return isinstance(value, (int, float)) and value == off
    return value == off


class OpenAIServing:
    """Shared request handling for one served model."""

    def __init__(self, client, metrics: ServerMetrics,
                 served_model_names: list[str], gate: AdmissionGate) -> None:
        self.client = client  # a clients.protocol.EngineClient (handed in, never picked here)
        self.metrics = metrics
        self.served_model_names = served_model_names
        self.gate = gate  # one per server: both endpoints share the waiting limit
        self._token_text: dict[int, str] = {}

    # server.prepare_pool.PreparePool (set by the app): templating and tokenizing run there.
    prepare_pool = None
    # --enable-prompt-tokens-details (set by the app): usage reports cached prompt tokens.
    prompt_tokens_details = False

    def usage(self, states: list[EngineRequestState]) -> UsageInfo:
        return make_usage(states, self.prompt_tokens_details)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    async def prepare_off_loop(self, prepare, *args):
        """`prepare(*args)` on the preparation thread (inline without a pool)."""
        if self.prepare_pool is None:
            return prepare(*args)
        return await self.prepare_pool.run(prepare, *args)

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.served_model_names:
            # 404 as OpenAI and vLLM answer it: clients tell "no such model" from a bad body
            shown = model if len(model) <= 100 else model[:100] + "..."  # not echoed in full
            raise APIError(404, f"The model `{shown}` does not exist. Served models: "
                                f"{', '.join(self.served_model_names)}", param="model",
                           code="model_not_found")

    def admit(self, num_new_requests: int) -> Admission:
        """503 while the engine is down (restarting), 429 over the waiting limit; else the
        reservation that `submit` hands over to the client as each engine request starts."""
        if not self.client.is_healthy:
            reason = (self.client.dead_message or "not running").strip().splitlines()[-1]
            raise APIError(503, f"The engine is not available ({reason[-300:]}); retry later",
                           type="service_unavailable_error", code="engine_unavailable")
        return self.gate.admit(num_new_requests)

    @staticmethod
    def reject_unsupported(request) -> None:
        """400 naming the first option we know and do not implement, unless it is sent with
        its "off" value; other unknown fields are accepted and logged once per name."""
        for name, value in (request.model_extra or {}).items():
            if name in UNSUPPORTED_FIELDS:
                if not any(_same_value(value, off) for off in UNSUPPORTED_FIELDS[name]):
                    raise bad_request(f"{name} is not supported by this server", param=name,
                                      code="unsupported_parameter")
            elif name not in _logged_unknown_fields \
                    and len(_logged_unknown_fields) < _MAX_LOGGED_UNKNOWN_FIELDS:
                _logged_unknown_fields.add(name)
                logger.warning("Ignoring unknown request field %r (not an option this server "
                               "knows; logged once)", name[:100])
        options = request.stream_options
        if options is not None:
            if not request.stream:
                raise bad_request("stream_options is only allowed when stream is true",
                                  param="stream_options")
            if options.continuous_usage_stats:
                raise bad_request("stream_options.continuous_usage_stats is not supported",
                                  param="stream_options", code="unsupported_parameter")

    def truncate_prompt(self, request, prompt: list[int]) -> list[int]:
        """vLLM's truncate_prompt_tokens: keep the prompt's last k tokens (-1: the context)."""
        k = request.truncate_prompt_tokens
        if k is None:
            return prompt
        if k == 0:
            raise bad_request("truncate_prompt_tokens must be -1 or at least 1",
                              param="truncate_prompt_tokens")
        if k == -1:
            k = self.client.max_model_len
        return prompt[-k:]

    def resolve_max_tokens(self, num_prompt_tokens: int, max_tokens: int | None) -> int:
        """The request's output budget; 400 if the prompt (plus budget) exceeds the context."""
        limit = self.client.max_model_len
        if num_prompt_tokens == 0:
            raise bad_request("The prompt is empty", param="prompt")
        if num_prompt_tokens >= limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens. However,"
                              f" your prompt has {num_prompt_tokens} tokens.",
                              param="prompt", code="context_length_exceeded")
        if max_tokens is None:
            return limit - num_prompt_tokens
        if num_prompt_tokens + max_tokens > limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens. However,"
                              f" you requested {num_prompt_tokens + max_tokens} tokens "
                              f"({num_prompt_tokens} in the prompt, {max_tokens} in the "
                              "completion).", param="max_tokens", code="context_length_exceeded")
        return max_tokens

    def check_token_ids(self, token_ids: list[int], param: str = "prompt") -> None:
        vocab_size = self.client.vocab_size
        for token_id in token_ids:
            if not 0 <= token_id < vocab_size:
                raise bad_request(f"Token id {token_id} is out of vocabulary "
                                  f"[0, {vocab_size})", param=param)

    def make_sampling_params(self, request, max_tokens: int, logprobs: int | None,
                             prompt_logprobs: int | None = None) -> SamplingParams:
        """The engine's params. Values the OpenAI API allows but the engine's float32
        sampling cannot represent are mapped to what they mean (as vLLM does): a temperature
        below 1e-5 is greedy, a top_p below 1e-7 keeps the top token, a top_k of at least
        the vocabulary keeps every token."""
        temperature = 1.0 if request.temperature is None else request.temperature
        if 0.0 < temperature < _MIN_TEMPERATURE:
            temperature = 0.0
        top_p = 1.0 if request.top_p is None else max(request.top_p, _MIN_TOP_P)
        top_k = request.top_k if request.top_k is not None else 0
        if top_k >= self.client.vocab_size:
            top_k = 0
        stop_token_ids = request.stop_token_ids or []
        self.check_token_ids(stop_token_ids, param="stop_token_ids")
        logit_bias = None
        if request.logit_bias:
            try:
                logit_bias = {int(k): v for k, v in request.logit_bias.items()}
            except ValueError:
                raise bad_request("logit_bias keys must be token ids (integers as strings)",
                                  param="logit_bias") from None
            self.check_token_ids(list(logit_bias), param="logit_bias")
        allowed = request.allowed_token_ids
        if allowed is not None:
            if not allowed:
                raise bad_request("allowed_token_ids must not be empty", param="allowed_token_ids")
            self.check_token_ids(allowed, param="allowed_token_ids")
        try:
            return SamplingParams(
                n=request.n, temperature=temperature, top_p=top_p, top_k=top_k,
                min_p=request.min_p if request.min_p is not None else 0.0,
                cache_salt=request.cache_salt,
                seed=request.seed, max_tokens=max_tokens, min_tokens=request.min_tokens,
                stop=request.stop or [], stop_token_ids=stop_token_ids,
                ignore_eos=request.ignore_eos, logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=request.skip_special_tokens,
                include_stop_str_in_output=request.include_stop_str_in_output,
                presence_penalty=request.presence_penalty or 0.0,
                frequency_penalty=request.frequency_penalty or 0.0,
                repetition_penalty=1.0 if request.repetition_penalty is None
                else request.repetition_penalty,
                logit_bias=logit_bias, allowed_token_ids=allowed,
                bad_words=request.bad_words or [],
                structured_outputs=structured_outputs_for(request))
        except InvalidParameter as e:
            raise bad_request(str(e), param=self.request_param(request, e.param)) from None

    # The request field a SamplingParams field comes from, where their names differ.
    sampling_field_names: dict[str, str] = {}

    def request_param(self, request, field: str) -> str | None:
        """The request's name for SamplingParams field `field` (None if it has none)."""
        name = self.sampling_field_names.get(field, field)
        return name if name in type(request).model_fields else None

    async def submit(self, request_id: str, prompt_token_ids: list[int],
                     params: SamplingParams, admission: Admission, mm_inputs=None,
                     ) -> AsyncIterator[EngineRequestState]:
        """Run one engine request; yields its state after every delta (same object, updated).
        Engine rejection -> 400 APIError; dead engine -> 500 APIError. `mm_inputs`: the
        prompt's images (deepinfer.wire.mm_inputs.MultiModalInputs)."""
        arrival = time.monotonic()
        state = EngineRequestState(request_id, prompt_token_ids,
                                   [ChoiceState(i) for i in range(params.n)])
        timer = self.metrics.request_timer(arrival)
        finished = False
        try:
            admission.start_one()  # no await before generate() counts it as waiting
            images = {"mm_inputs": mm_inputs} if mm_inputs is not None else {}
            async for delta in self.client.generate(request_id, prompt_token_ids, params,
                                                    arrival, **images):
                now = time.monotonic()
                state.apply(delta)
                timer.on_tokens(now, sum(len(c.token_ids) for c in delta.choices),
                                len(prompt_token_ids))
                if delta.finished:
                    finished = True
                    timer.on_finish(now, state.choices[0].finish_reason, delta.times)
                yield state
        except ValueError as e:
            finished = True  # rejected by the engine: never ran; its checks name their field
            raise bad_request(str(e), param=e.param if isinstance(e, InvalidParameter)
                              else "prompt") from None
        except RequestFailedError as e:
            finished = True  # the engine dropped it: counted as a failure, not an abort
            timer.on_failure("engine" if e.engine_fault else "request")
            raise APIError(500, f"The request failed in the engine: {str(e)[-500:]}",
                           type="internal_error", code="request_failed") from None
        except EngineDeadError as e:
            timer.on_failure("engine_dead")
            raise APIError(500, f"The engine died: {str(e)[-500:]}", type="internal_error",
                           code="engine_dead") from None
        finally:
            if not finished:  # the client left (or the engine died) mid-request
                timer.on_finish(time.monotonic(), "abort", None)

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.client.tokenizer.decode([token_id])
            self._token_text[token_id] = text
        return text
