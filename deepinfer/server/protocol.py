"""OpenAI-compatible request and response models (pydantic), with vLLM's extensions.

Requests accept unknown fields (kept in `model_extra`, logged once per name by the serving
layer) so clients that send extra OpenAI options keep working; options we know and cannot
honour (`UNSUPPORTED_FIELDS`, and declared fields with a non-default value) are rejected with
a 400 naming the field. Responses follow the OpenAI shapes field for field; vLLM extensions
(`token_ids`, `prompt_token_ids`, `stop_reason`) are present only when they apply.
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from deepinfer.server.request_schema import TOKEN_ID_KEYS_MARK, Int, TokenId, integer


INT64_MIN, INT64_MAX = -2 ** 63, 2 ** 63 - 1  # what the engine messages carry


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


# --- errors ------------------------------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# --- shared pieces -----------------------------------------------------------------------------


# Requests are validated strictly (no "2" for an int, no false for a token id): the body must
# be what the published schema says, so a client's mistake is a 400 instead of a guess.
STRICT_REQUEST = ConfigDict(extra="allow", strict=True)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM; not implemented: True is a 400


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


# OpenAI / vLLM request options this server does not implement, with the value(s) that mean
# "off" (accepted: clients often send the defaults). Any other value is a 400 naming the
# field, never a silent drop: each of these would change the output if honoured.
_OFF = (None, False, [], {}, "")
UNSUPPORTED_FIELDS: dict[str, tuple] = {
    # vLLM sampling extensions
    "prompt_logprobs": _OFF, "use_beam_search": _OFF,
    "length_penalty": (None, 1, 1.0), "spaces_between_special_tokens": (None, True),
    "logits_processors": _OFF, "guided_whitespace_pattern": _OFF, "guided_decoding_backend": _OFF,
    "allowed_token_ids_per_position": _OFF, "prompt_embeds": _OFF, "priority": (None, 0),
    "mm_processor_kwargs": _OFF, "vllm_xargs": _OFF, "kv_transfer_params": _OFF,
    "min_p_per_token": _OFF, "detokenize": (None, True), "lora_request": _OFF,
    # chat (OpenAI and vLLM)
    "functions": _OFF, "function_call": (None, "none", "auto"),
    "audio": _OFF, "modalities": (None, ["text"]), "chat_template": _OFF,
    "documents": _OFF,
    "echo": _OFF, "add_special_tokens": (None, False),
}
# (A request's declared fields never reach this table: completions' `echo`,
# `add_special_tokens` and `prompt_logprobs` are checked by the endpoint.)


_NOT_ZERO = {"not": {"const": 0}}


class _SamplingFields(BaseModel):
    """Sampling options shared by both endpoints (OpenAI names, then vLLM extensions)."""

    model_config = STRICT_REQUEST

    model: str | None = None
    n: integer(ge=1, le=128) = 1
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: integer(ge=INT64_MIN, le=INT64_MAX) | None = None
    stop: str | list[Annotated[str, Field(min_length=1)]] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]],
                          Field(json_schema_extra={TOKEN_ID_KEYS_MARK: True})] | None = None
    user: str | None = None
    # vLLM: only requests with the same salt share prefix-cache blocks (tenant isolation).
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    # vLLM extensions
    top_k: integer(ge=-1) | None = None  # -1 or 0: disabled
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    min_tokens: integer(ge=0) = 0
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=100.0)
    allowed_token_ids: list[TokenId] | None = Field(default=None, min_length=1)
    bad_words: list[Annotated[str, Field(pattern=r"\S")]] | None = None  # not blank
    # Keep only the prompt's last k tokens (-1: as many as the context allows; vLLM).
    truncate_prompt_tokens: integer(ge=-1, json_schema_extra=_NOT_ZERO) | None = None
    # Structured outputs (server/structured_request.py): OpenAI's response_format, vLLM's
    # structured_outputs and its older guided_* fields.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[Annotated[str, Field(min_length=1)]] | None = Field(default=None,
                                                                            min_length=1)
    guided_grammar: str | None = None


# --- /v1/completions ---------------------------------------------------------------------------


def _non_empty_prompt(schema: dict) -> None:
    """Every form of `prompt` in the schema at least one character / item long, at every level."""
    def visit(node: dict) -> None:
        if node.get("type") == "string":
            node["minLength"] = 1
        elif node.get("type") == "array":
            node["minItems"] = 1
            visit(node.get("items", {}))
    for branch in schema.get("anyOf", []):
        visit(branch)


class CompletionRequest(_SamplingFields):
    # Empty prompts are refused by the serving code (with its own message); the schema says so.
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]] = Field(
        json_schema_extra=lambda schema: _non_empty_prompt(schema))
    max_tokens: integer(ge=0) | None = 16  # 0: echo only
    logprobs: integer(ge=0, le=20) | None = None
    prompt_logprobs: integer(ge=0, le=20) | None = None  # vLLM
    echo: bool = False
    suffix: str | None = None
    best_of: Int | None = None
    add_special_tokens: bool = True  # vLLM: the tokenizer's BOS etc. on text prompts


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's Logprob, as prompt_logprobs report it."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    # vLLM: None for the first prompt token, then {token id: PromptLogprob} per prompt token
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# Streaming completion chunks use the same shape as the response (OpenAI does too).
CompletionStreamResponse = CompletionResponse


# --- /v1/chat/completions ----------------------------------------------------------------------


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")

# `messages` is validated by hand (serving_chat.normalize_messages, for OpenAI-shaped 400s);
# this is what the OpenAPI schema tells clients about one message.
_MESSAGE_SCHEMA = {
    "type": "object", "required": ["role"],
    "properties": {
        "role": {"type": "string", "enum": list(CHAT_ROLES)},
        "content": {"anyOf": [
            {"type": "string"},
            {"type": "array", "items": {
                "type": "object", "required": ["type"],
                "properties": {"type": {"type": "string", "const": "text"},
                               "text": {"type": "string"}}}},
            {"type": "null"}]},
        "name": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "tool_call_id": {"type": "string"}},
    # a tool result names the call it answers
    "anyOf": [{"properties": {"role": {"enum": [r for r in CHAT_ROLES if r != "tool"]}}},
              {"properties": {"role": {"const": "tool"},
                              "tool_call_id": {"minLength": 1}}, "required": ["tool_call_id"]}],
}


# What server/tool_calling.checked_tools accepts as one tool, as far as a schema can say.
_TOOL_SCHEMA = {
    "required": ["function"],
    "properties": {
        "type": {"const": "function"},
        "function": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string", "pattern": r"^[A-Za-z0-9_.\-]{1,64}$"},
            "description": {"type": "string"}, "parameters": {"type": "object"}}}},
}

_TOOL_CHOICE_SCHEMA = {"required": ["type", "function"], "properties": {
    "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}}

# Template variables a request's chat_template_kwargs may not set (the server sets them).
RESERVED_TEMPLATE_VARS = ("messages", "tools", "add_generation_prompt", "tokenize",
                          "chat_template", "continue_final_message", "return_dict")


class ChatCompletionRequest(_SamplingFields):
    messages: list[dict[str, Any]] = Field(min_length=1,
                                           json_schema_extra={"items": _MESSAGE_SCHEMA})
    max_tokens: integer(ge=1) | None = None
    max_completion_tokens: integer(ge=1) | None = None
    logprobs: bool = False
    top_logprobs: integer(ge=0, le=20) | None = None
    add_generation_prompt: bool = True
    # Tool calling (server/tool_calling.py); tool_choice: "none" | "auto" | "required" |
    # {"type": "function", "function": {"name": ...}}
    tools: list[Annotated[dict[str, Any], Field(json_schema_extra=_TOOL_SCHEMA)]] | None = None
    tool_choice: Annotated[str, Field(json_schema_extra={"enum": ["none", "auto", "required"]})] \
        | Annotated[dict[str, Any], Field(json_schema_extra=_TOOL_CHOICE_SCHEMA)] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: Annotated[dict[str, Any], Field(json_schema_extra={  # template vars
        "propertyNames": {"not": {"enum": list(RESERVED_TEMPLATE_VARS)}}})] | None = None
    # Continue the last (assistant) message instead of opening a new turn (vLLM); DeepSeek's
    # spelling is `"prefix": true` on that message.
    continue_final_message: bool = False


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class _Reasoning(BaseModel):
    """`reasoning_content` (--reasoning-parser; DeepSeek's name) and `reasoning` (vLLM's newer
    name) carry the same text, so clients written for either read it."""

    @model_validator(mode="after")
    def _same_reasoning(self):
        if self.reasoning is None:
            self.reasoning = self.reasoning_content
        elif self.reasoning_content is None:
            self.reasoning_content = self.reasoning
        return self


class ChatMessage(_Reasoning):
    role: str
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    prompt_token_ids: list[int] | None = None


class DeltaMessage(_Reasoning):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None


# --- /v1/models --------------------------------------------------------------------------------


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now_s)
    owned_by: str = "deepinfer"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
