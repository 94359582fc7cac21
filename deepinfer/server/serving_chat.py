"""POST /v1/chat/completions: messages → chat template → one engine request with n choices."""
from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from deepinfer.server.chat_output import ChatOutputParser
from deepinfer.server.errors import APIError, bad_request
from deepinfer.server.protocol import (
    ChatChoiceLogprobs, ChatCompletionChoice, ChatCompletionRequest, ChatCompletionResponse,
    ChatCompletionStreamChoice, ChatCompletionStreamResponse, ChatTokenLogprob,
    CHAT_ROLES, ChatTopLogprob, DeltaMessage, RESERVED_TEMPLATE_VARS, random_id,
)
from deepinfer.server.reasoning_parsers import REASONING_PARSERS
from deepinfer.server.serving_base import (
    SSE_DONE, EngineRequestState, OpenAIServing, StreamCursor, json_logprob,
    sse_event,
)
from deepinfer.server.structured_request import asks_structured_output
from deepinfer.server.tool_calling import (
    ToolPlan, message_tool_fields, plan_tools, template_renders, with_arguments_as_text,
)
from deepinfer.server.tool_parsers import get_tool_parser

_ROLES = CHAT_ROLES


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """{role, content: str} dicts for the chat template (with an assistant's tool_calls and a
    tool result's tool_call_id); 400 on anything else. Content given as a list of parts keeps
    its text parts, joined by newlines (as vLLM)."""
    out = []
    for i, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        if role not in _ROLES:
            raise bad_request(f"messages[{i}].role must be one of {', '.join(_ROLES)}",
                              param=f"messages[{i}].role")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise bad_request(f"messages[{i}].content: only text parts are supported",
                                      param=f"messages[{i}].content")
                if not isinstance(part.get("text", ""), str):
                    raise bad_request(f"messages[{i}].content: a text part's text must be a "
                                      "string", param=f"messages[{i}].content")
                texts.append(part.get("text", ""))
            content = "\n".join(texts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise bad_request(f"messages[{i}].content must be a string or a list of parts",
                              param=f"messages[{i}].content")
        if message.get("name") is not None and not isinstance(message["name"], str):
            raise bad_request(f"messages[{i}].name must be a string", param=f"messages[{i}].name")
        out.append({"role": "system" if role == "developer" else role, "content": content,
                    **message_tool_fields(i, message)})
    return out


_RESERVED_TEMPLATE_VARS = set(RESERVED_TEMPLATE_VARS)


def continues_final_message(request) -> bool:
    """Whether the prompt ends inside the last message, which the model continues: vLLM's
    continue_final_message, or DeepSeek's `"prefix": true` on a final assistant message.
    400 for a prefix anywhere else, or with add_generation_prompt set explicitly."""
    messages = request.messages
    for i, message in enumerate(messages):
        if message.get("prefix") not in (None, False):
            if i != len(messages) - 1 or message.get("role") != "assistant" \
                    or message.get("prefix") is not True:
                raise bad_request("prefix: true is allowed on the last message only, an "
                                  "assistant message", param=f"messages[{i}].prefix")
    continues = request.continue_final_message or messages[-1].get("prefix") is True
    if continues:
        if messages[-1].get("role") != "assistant":
            raise bad_request("continue_final_message needs a final assistant message",
                              param="continue_final_message")
        if request.add_generation_prompt and "add_generation_prompt" in request.model_fields_set:
            raise bad_request("continue_final_message and add_generation_prompt exclude each "
                              "other", param="add_generation_prompt")
    return continues


def apply_chat_template(tokenizer, messages: list[dict[str, Any]],
                        add_generation_prompt: bool = True, *, tools: list[dict] | None = None,
                        chat_template: str | None = None,
                        template_kwargs: dict[str, Any] | None = None,
                        continue_final_message: bool = False) -> list[int]:
    """Render with the template (the tokenizer's, or `chat_template`), then tokenize without
    adding special tokens again (the template already holds them). `continue_final_message`:
    the rendering stops right after the last message's content (transformers cuts it there)."""
    extra = dict(template_kwargs or {})
    if continue_final_message:
        extra["continue_final_message"] = True
        add_generation_prompt = False
    if tools is not None:
        extra["tools"] = tools
    if chat_template is not None:
        extra["chat_template"] = chat_template
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                         tokenize=False, **extra)
    return tokenizer.encode(text, add_special_tokens=False)


def has_image_parts(messages: list[dict[str, Any]]) -> bool:
    return any(isinstance(m, dict) and isinstance(m.get("content"), list)
               and any(isinstance(p, dict) and p.get("type") == "image_url" for p in m["content"])
               for m in messages)


class OpenAIServingChat(OpenAIServing):
    sampling_field_names = {"logprobs": "top_logprobs"}  # chat's count of alternatives
    # Vision-language models (colocated): the checkpoint's MultiModalProcessor and the
    # operator's MediaPolicy, set by `enable_images`; None = image parts are refused.
    mm_processor = None
    media_policy = None
    # Server-wide chat options (`configure`): template override and parsers.
    chat_template: str | None = None
    auto_tool_parser = None  # a ToolParser when --enable-auto-tool-choice
    reasoning_parser = None  # a ThinkReasoningParser

    def configure(self, options) -> None:
        """Apply a deepinfer.server.chat_options.ChatOptions."""
        self.chat_template = options.chat_template
        if options.enable_auto_tool_choice:
            self.auto_tool_parser = get_tool_parser(options.tool_call_parser)
        if options.reasoning_parser:
            self.reasoning_parser = REASONING_PARSERS[options.reasoning_parser]

    def _tool_plan(self, request: ChatCompletionRequest) -> ToolPlan:
        return plan_tools(request, self.auto_tool_parser)

    def _output_parser(self, request: ChatCompletionRequest) -> ChatOutputParser:
        """How choices become messages. A grammar constrains the output from its first token,
        so a constrained output has no reasoning to split off."""
        plan = self._tool_plan(request)
        constrained = plan.structured is not None or asks_structured_output(request)
        return ChatOutputParser(plan, None if constrained else self.reasoning_parser)

    def render_prompt(self, request: ChatCompletionRequest, plan: ToolPlan) -> list[int]:
        """The prompt; 400 where the template would drop the tools or tool calls."""
        messages = normalize_messages(request.messages)
        tokenizer = self.client.tokenizer
        if plan.tools and not template_renders(tokenizer, self.chat_template, "tools"):
            raise bad_request(f"The chat template of {self.model_name} does not render tools; "
                              "serve it with --chat-template FILE (a template that does)",
                              param="tools", code="unsupported_parameter")
        if any("tool_calls" in m for m in messages) \
                and not template_renders(tokenizer, self.chat_template, "tool_calls"):
            raise bad_request(f"The chat template of {self.model_name} does not render tool "
                              "calls; serve it with --chat-template FILE (a template that does)",
                              param="messages", code="unsupported_parameter")
        kwargs = request.chat_template_kwargs or {}
        reserved = sorted(_RESERVED_TEMPLATE_VARS & set(kwargs))
        if reserved:
            raise bad_request(f"chat_template_kwargs may not set {', '.join(reserved)}",
                              param="chat_template_kwargs")
        continues = continues_final_message(request)
        def render(template_messages):
            return apply_chat_template(tokenizer, template_messages, request.add_generation_prompt,
                                       tools=plan.tools, chat_template=self.chat_template,
                                       template_kwargs=kwargs, continue_final_message=continues)
        try:
            try:
                return render(messages)
            except TypeError:  # a template that joins call arguments in as text (DeepSeek's)
                if not any("tool_calls" in m for m in messages):
                    raise
                return render(with_arguments_as_text(messages, request.messages))
        except Exception as e:  # template errors are the caller's messages' fault
            raise bad_request(f"Cannot apply the chat template: {e}", param="messages") from None

    def enable_images(self, processor, policy) -> None:
        self.mm_processor, self.media_policy = processor, policy

    async def _process_images(self, request: ChatCompletionRequest):
        """(prompt token ids, MultiModalInputs) for a chat with image_url parts; 400 for a bad
        or refused image. Decoding and preprocessing run off the event loop."""
        from deepinfer.multimodal.processor import load_message_images

        if self.mm_processor is None:
            raise bad_request(f"model {self.model_name} does not accept images", param="messages")
        messages = []
        for i, message in enumerate(request.messages):
            role = message.get("role")
            if role not in _ROLES:
                raise bad_request(f"messages[{i}].role must be one of {', '.join(_ROLES)}",
                                  param=f"messages[{i}].role")
            content = message.get("content")
            if isinstance(content, list) and any(
                    not isinstance(p, dict) or p.get("type") not in ("text", "image_url") for p in content):
                raise bad_request(f"messages[{i}].content: only text and image_url parts are supported",
                                  param=f"messages[{i}].content")
            messages.append({"role": "system" if role == "developer" else role,
                             "content": "" if content is None else content})

        def process():
            loaded = load_message_images(messages, self.media_policy)
            return self.mm_processor.process_chat(loaded, request.add_generation_prompt)

        try:
            return await asyncio.to_thread(process)
        except ValueError as e:  # ImageInputError included: the image's or the messages' fault
            raise bad_request(str(e), param="messages") from None

    def _prepare(self, request: ChatCompletionRequest, prompt: list[int] | None = None):
        self.check_model(request.model)
        self.reject_unsupported(request)
        if request.top_logprobs is not None and not request.logprobs:
            raise bad_request("top_logprobs requires logprobs=true", param="top_logprobs")
        plan = self._tool_plan(request)
        if prompt is None:
            prompt = self.truncate_prompt(request, self.render_prompt(request, plan))
        elif plan.tools:
            raise bad_request("tools are not supported with images", param="tools",
                              code="unsupported_parameter")
        elif request.truncate_prompt_tokens is not None:  # would cut image tokens
            raise bad_request("truncate_prompt_tokens is not supported with images",
                              param="truncate_prompt_tokens", code="unsupported_parameter")
        max_tokens = request.max_completion_tokens or request.max_tokens
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        params = self.make_sampling_params(request, self.resolve_max_tokens(len(prompt),
                                                                            max_tokens), logprobs)
        if plan.structured is not None:  # tool_choice required / named: the calls' grammar
            if params.structured_outputs is not None:
                raise bad_request(f"tool_choice {plan.mode} cannot be combined with another "
                                  "structured output constraint", param="tool_choice")
            params = dataclasses.replace(params, structured_outputs=plan.structured)
        return prompt, params, self.admit(1)

    async def create(self, request: ChatCompletionRequest):
        """A ChatCompletionResponse, or an async iterator of SSE strings when streaming."""
        mm_inputs = None
        if self.mm_processor is not None or has_image_parts(request.messages):
            # A vision-language checkpoint's chat template lives with its processor.
            self.check_model(request.model)
            # Held while the images are fetched (the waiting limit bounds image work), then
            # handed to `_prepare`'s own admission with no await in between.
            fetching = self.admit(1)
            try:
                prompt, mm_inputs = await self._process_images(request)
            finally:
                fetching.release()
            prompt, params, admission = self._prepare(request, prompt)
        else:
            prompt, params, admission = await self.prepare_off_loop(self._prepare, request)
        response_id = random_id("chatcmpl")
        stream = self.submit(response_id, prompt, params, admission, mm_inputs=mm_inputs)
        if request.stream:
            return self._stream(request, response_id, stream, admission)
        state = None
        try:
            async for state in stream:
                pass
        finally:
            admission.release()
        output = self._output_parser(request)
        choices = []
        for c in state.choices:
            message, finish_reason = output.message(c.text, c.finish_reason)
            choices.append(ChatCompletionChoice(
                index=c.index, message=message, finish_reason=finish_reason,
                stop_reason=c.stop_reason,
                logprobs=self._logprobs(c.logprobs) if request.logprobs else None,
                token_ids=c.token_ids if request.return_token_ids else None))
        return ChatCompletionResponse(
            id=response_id, model=self.model_name, choices=choices, usage=self.usage([state]),
            prompt_token_ids=prompt if request.return_token_ids else None)

    def _logprobs(self, logprobs) -> ChatChoiceLogprobs:
        content = []
        for lp in logprobs:
            token = self.token_text(lp.token_id)
            top = [ChatTopLogprob(token=self.token_text(t), logprob=json_logprob(v),
                                  bytes=list(self.token_text(t).encode()))
                   for t, v in zip(lp.top_token_ids, lp.top_logprobs)]
            content.append(ChatTokenLogprob(token=token, logprob=json_logprob(lp.logprob),
                                            bytes=list(token.encode()), top_logprobs=top))
        return ChatChoiceLogprobs(content=content)

    async def _stream(self, request: ChatCompletionRequest, response_id: str,
                      stream: AsyncIterator[EngineRequestState], admission,
                      ) -> AsyncIterator[str]:
        def chunk(choices, usage=None, prompt_token_ids=None) -> str:
            return sse_event(ChatCompletionStreamResponse(
                id=response_id, model=self.model_name, choices=choices, usage=usage,
                prompt_token_ids=prompt_token_ids))

        cursors = [StreamCursor() for _ in range(request.n)]
        output = self._output_parser(request)
        streamers = None if output.is_plain else [output.streamer() for _ in range(request.n)]
        state = None
        try:
            first = True
            async for state in stream:
                if first:  # the role comes first, before any content (as OpenAI)
                    first = False
                    yield chunk([ChatCompletionStreamChoice(
                        index=i, delta=DeltaMessage(role="assistant", content=""))
                        for i in range(request.n)], prompt_token_ids=state.prompt_token_ids
                        if request.return_token_ids else None)
                for choice in state.choices:
                    new = cursors[choice.index].advance(choice)
                    if new is None:
                        continue
                    finish_reason = choice.finish_reason
                    if streamers is None:
                        delta = DeltaMessage(content=choice.text[new.char_start:])
                    else:
                        streamer = streamers[choice.index]
                        delta = streamer.update(choice.text, finish_reason is not None)
                        if delta is None:
                            if finish_reason is None and not request.logprobs:
                                continue
                            delta = DeltaMessage()
                        if streamer.called_tools and finish_reason == "stop":
                            finish_reason = "tool_calls"
                    yield chunk([ChatCompletionStreamChoice(
                        index=choice.index, delta=delta,
                        logprobs=self._logprobs(choice.logprobs[new.token_start:])
                        if request.logprobs else None,
                        finish_reason=finish_reason, stop_reason=choice.stop_reason,
                        token_ids=choice.token_ids[new.token_start:]
                        if request.return_token_ids else None)])
            if request.stream_options and request.stream_options.include_usage:
                yield chunk([], usage=self.usage([state]))
        except APIError as e:
            yield sse_event(e.body())
        finally:
            admission.release()
        yield SSE_DONE
