"""vLLM's /tokenize and /detokenize: what the server would feed the engine for a prompt or a
chat, and the text of token ids, without generating. Agents use them to count a prompt
against the context before sending it and to render a chat exactly as the server will.

Request shapes follow vLLM: /tokenize takes either `prompt` (+ `add_special_tokens`) or
`messages` (+ the chat template options of /v1/chat/completions); both may ask for
`return_token_strs`. The chat form renders through the chat endpoint's own template path, so
the ids are the ones a chat request with the same messages and tools would be given."""
from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from deepinfer.server.errors import bad_request, from_validation_error
from deepinfer.server.protocol import ChatCompletionRequest
from deepinfer.server.request_schema import TokenId
from deepinfer.server.serving_base import OpenAIServing
from deepinfer.server.serving_chat import has_image_parts
from deepinfer.server.tool_calling import ToolPlan, checked_tools

# One request may not ask for more ids to be turned into text than this (the body cap bounds
# the bytes; this bounds the work of one detokenize call).
MAX_DETOKENIZE_TOKENS = 1 << 20


class _TokenizeBase(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    return_token_strs: bool = False


class TokenizeCompletionRequest(_TokenizeBase):
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(_TokenizeBase):
    messages: list[dict[str, Any]] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the template holds them
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    tokens: list[TokenId] = Field(max_length=MAX_DETOKENIZE_TOKENS)


class DetokenizeResponse(BaseModel):
    prompt: str


def parse_tokenize_body(body: bytes) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """The request form is chosen by its fields (`messages` -> chat), then validated; 400 for
    anything else."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        raise bad_request("The request body is not valid JSON") from None
    if not isinstance(data, dict):
        raise bad_request("The request body must be a JSON object")
    cls = TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from None


class OpenAIServingTokenize(OpenAIServing):
    """Needs the app's chat serving (`chat`) for the template path and its options."""

    def __init__(self, *args, chat, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.chat = chat

    async def tokenize(self, request: TokenizeCompletionRequest | TokenizeChatRequest
                       ) -> TokenizeResponse:
        self.check_model(request.model)
        tokens = await self.prepare_off_loop(self._tokens, request)
        strs = None
        if request.return_token_strs:
            strs = self.client.tokenizer.convert_ids_to_tokens(tokens)
        return TokenizeResponse(count=len(tokens), max_model_len=self.client.max_model_len,
                                tokens=tokens, token_strs=strs)

    def _tokens(self, request) -> list[int]:
        tokenizer = self.client.tokenizer
        if isinstance(request, TokenizeCompletionRequest):
            return tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens)
        if has_image_parts(request.messages):
            raise bad_request("/tokenize does not take image parts", param="messages",
                              code="unsupported_parameter")
        fields = request.model_dump(include={"messages", "add_generation_prompt",
                                             "continue_final_message", "chat_template_kwargs",
                                             "tools"})
        chat_request = ChatCompletionRequest.model_validate(fields)
        # The tools are rendered as a generation request would render them; no tool_choice
        # (and so no parser) is needed to count or see the prompt.
        tools = checked_tools(request.tools) if request.tools else None
        tokens = self.chat.render_prompt(chat_request, ToolPlan("auto", tools))
        if request.add_special_tokens and tokenizer.bos_token_id is not None \
                and tokens[:1] != [tokenizer.bos_token_id]:
            tokens = [tokenizer.bos_token_id] + tokens
        return tokens

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(request.model)
        self.check_token_ids(request.tokens, param="tokens")
        text = await self.prepare_off_loop(self.client.tokenizer.decode, request.tokens)
        return DetokenizeResponse(prompt=text)
