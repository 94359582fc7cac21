"""Typed messages between the API front and an engine process (msgpack via msgspec).

This is the seam between the HTTP front door and whatever runs the model: today one colocated
engine process, later the disaggregated prefill/decode workers. Two one-way ZMQ PUSH/PULL
channels carry them:

    front ──FrontMessage──▶ engine      (AddRequest | AbortRequest | Shutdown)
    front ◀──EngineMessage── engine     (EngineReady | EngineOutputs | EngineDead)

Outputs are *deltas*: each `ChoiceDelta` carries only the tokens, text and logprobs produced
since the previous message for that (request, choice), so a long generation costs O(tokens)
on the wire, not O(tokens^2).
"""
from __future__ import annotations

import msgspec

from deepinfer.core.scheduler_output import Logprob, TokenLogprobs
from deepinfer.wire.mm_inputs import MultiModalInputs
from deepinfer.invalid_parameter import InvalidParameter
from deepinfer.sampling_params import SamplingParams
from deepinfer.wire.tokenizer_files import TokenizerFiles

# --- front -> engine ---------------------------------------------------------------------------


class AddRequest(msgspec.Struct, tag=True):
    """Start a request. `arrival_time` is `time.monotonic()` in the front (system-wide clock)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    mm_inputs: MultiModalInputs | None = None  # the prompt's images (vision-language models)


class AbortRequest(msgspec.Struct, tag=True):
    """Stop requests and free their KV blocks; unknown ids are ignored."""

    request_ids: list[str]


class Shutdown(msgspec.Struct, tag=True):
    """Ask the engine loop to exit cleanly."""


FrontMessage = AddRequest | AbortRequest | Shutdown

# --- engine -> front ---------------------------------------------------------------------------


class EngineReady(msgspec.Struct, tag=True):
    """Sent once after the model is loaded. `tokenizer_files` lets the front tokenize with
    exactly the engine's tokenizer (chat template included) without loading the model."""

    model_name: str
    max_model_len: int
    vocab_size: int
    tokenizer_files: TokenizerFiles


class ChoiceDelta(msgspec.Struct):
    """New output of one choice (`index` < n) since the last message for it."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None
    cumulative_logprob: float | None = None


class RequestTimes(msgspec.Struct):
    """Engine-side timestamps (time.monotonic(), same clock as the front)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


class RequestDelta(msgspec.Struct):
    request_id: str
    choices: list[ChoiceDelta]
    finished: bool
    num_cached_tokens: int = 0
    times: RequestTimes | None = None  # only on the final delta
    # SamplingParams.prompt_logprobs (vLLM-shaped, core.scheduler_output.PromptLogprobs): once, on
    # the first delta after the prompt is computed
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


class RequestError(msgspec.Struct):
    """The engine rejected a request (e.g. prompt longer than the context), or (`failed`) a
    step failed while running it; either way it holds no state for it now.
    `engine_fault`: the failure was the engine's (every request in flight failed)."""

    request_id: str
    message: str
    failed: bool = False
    engine_fault: bool = False
    param: str | None = None  # a rejection's field (InvalidParameter.param), if it names one


def rejection_error(error: RequestError) -> ValueError:
    """The front door's exception for an engine's rejection: InvalidParameter when the engine
    named the field, so the 400's `param` never depends on how the message is worded."""
    if error.param is not None:
        return InvalidParameter(error.param, error.message)
    return ValueError(error.message)


class EngineStatsSnapshot(msgspec.Struct):
    """Engine gauges and cumulative counters after a step (or while idle)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_kv_blocks_used: int = 0
    num_kv_blocks_total: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    step_time_s: float | None = None
    predicted_step_time_s: float | None = None
    prediction_abs_error_sum: float = 0.0  # sum over predicted steps of |pred - meas| / meas
    num_predicted_steps: int = 0
    num_requests_received: int = 0  # AddRequests consumed so far: lets the front size its queue
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = []
    num_failed_steps: int = 0  # engine steps that raised (isolated, the engine kept serving)
    num_failed_requests: int = 0  # requests failed because of them
    # Vision-language engines (colocated): image embedding lookups and tower runs; None: no tower.
    embedding_cache_hits: int | None = None
    embedding_cache_misses: int = 0
    num_images_encoded: int = 0
    wire_frames_dropped: dict[str, int] = {}  # this process's, "channel/reason" -> count


class EngineOutputs(msgspec.Struct, tag=True):
    outputs: list[RequestDelta]
    errors: list[RequestError] = []
    stats: EngineStatsSnapshot | None = None


class EngineDead(msgspec.Struct, tag=True):
    """The engine loop hit an unrecoverable error and is exiting."""

    message: str


EngineMessage = EngineReady | EngineOutputs | EngineDead


def make_encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def make_front_decoder() -> msgspec.msgpack.Decoder:
    """Decoder for messages the engine receives."""
    return msgspec.msgpack.Decoder(FrontMessage)


def make_engine_decoder() -> msgspec.msgpack.Decoder:
    """Decoder for messages the front receives."""
    return msgspec.msgpack.Decoder(EngineMessage)
