"""POST /v1/completions: text or token-id prompts (one or many), streamed or not.

Prompt i with n choices becomes engine request `{id}-{i}`; its choice j is reported as
`index = i * n + j`, as OpenAI and vLLM do.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from deepinfer.server.errors import APIError, bad_request
from deepinfer.server.fim import fim_prompt
from deepinfer.server.prompt_tokens import encode_within_context
from deepinfer.server.protocol import (
    CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, PromptLogprob,
    random_id,
)
from deepinfer.server.serving_base import (
    SSE_DONE, ChoiceState, EngineRequestState, OpenAIServing, StreamCursor, json_logprob,
    sse_event,
)


async def merge_streams(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """Interleave several async iterators, yielding (stream index, item) as items arrive.
    Exceptions propagate; leaving early cancels the rest (which aborts their requests)."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator) -> None:
        try:
            async for item in stream:
                await queue.put((i, item))
            await queue.put((i, done))
        except Exception as e:  # forwarded to the consumer
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class OpenAIServingCompletion(OpenAIServing):

    def _prompts(self, request: CompletionRequest) -> list[list[int]]:
        prompt = request.prompt
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise bad_request("The prompt is empty", param="prompt")
        if request.suffix:
            return [self.truncate_prompt(request, p) for p in self._fim_prompts(request, prompt)]
        if isinstance(prompt[0], int):
            prompt = [prompt]
        tokenized = []
        for p in prompt:
            if isinstance(p, str):
                tokenized.append(encode_within_context(
                    self.client.tokenizer, p, None if request.truncate_prompt_tokens is not None
                    else self.client.max_model_len, request.add_special_tokens))
            else:
                self.check_token_ids(p)
                tokenized.append(list(p))
        return [self.truncate_prompt(request, p) for p in tokenized]

    def _fim_prompts(self, request: CompletionRequest, prompts: list) -> list[list[int]]:
        if not all(isinstance(p, str) for p in prompts):
            raise bad_request("suffix needs text prompts", param="suffix")
        try:
            return [fim_prompt(self.client.tokenizer, p, request.suffix,
                               request.add_special_tokens) for p in prompts]
        except ValueError as e:
            raise bad_request(f"{e} ({self.model_name})", param="suffix",
                              code="unsupported_parameter") from None

    def _prepare(self, request: CompletionRequest):
        self.check_model(request.model)
        self.reject_unsupported(request)
        if request.echo:
            raise bad_request("echo is not supported", param="echo", code="unsupported_parameter")
        if request.best_of is not None and request.best_of != request.n:
            raise bad_request("best_of other than n is not supported", param="best_of",
                              code="unsupported_parameter")
        if request.prompt_logprobs is not None and request.stream:
            raise bad_request("prompt_logprobs are not available when stream is true",
                              param="prompt_logprobs")
        prompts = self._prompts(request)
        params = [self.make_sampling_params(
            request, self.resolve_max_tokens(len(p), request.max_tokens), request.logprobs,
            request.prompt_logprobs) for p in prompts]
        return prompts, params, self.admit(len(prompts))

    async def create(self, request: CompletionRequest):
        """A CompletionResponse, or an async iterator of SSE strings when streaming."""
        prompts, params, admission = await self.prepare_off_loop(self._prepare, request)
        response_id = random_id("cmpl")
        streams = [self.submit(f"{response_id}-{i}", p, sp, admission)
                   for i, (p, sp) in enumerate(zip(prompts, params))]
        if request.stream:
            return self._stream(request, response_id, streams, admission)
        states: list[EngineRequestState | None] = [None] * len(streams)
        try:
            async for i, state in merge_streams(streams):
                states[i] = state
        finally:
            admission.release()
        choices = [self._choice(request, state, choice, i * request.n + choice.index)
                   for i, state in enumerate(states) for choice in state.choices]
        return CompletionResponse(id=response_id, model=self.model_name, choices=choices,
                                  usage=self.usage(states))

    def _choice(self, request: CompletionRequest, state: EngineRequestState,
                choice: ChoiceState, index: int) -> CompletionChoice:
        return CompletionChoice(
            index=index, text=choice.text, finish_reason=choice.finish_reason,
            stop_reason=choice.stop_reason,
            logprobs=self._logprobs(choice.logprobs, 0) if request.logprobs is not None
            else None,
            token_ids=choice.token_ids if request.return_token_ids else None,
            prompt_token_ids=state.prompt_token_ids if request.return_token_ids else None,
            prompt_logprobs=self._prompt_logprobs(state.prompt_logprobs)
            if request.prompt_logprobs is not None else None)

    @staticmethod
    def _prompt_logprobs(entries) -> list[dict[int, PromptLogprob] | None] | None:
        if entries is None:
            return None
        return [None if e is None else {
            t: PromptLogprob(logprob=json_logprob(lp.logprob), rank=lp.rank,
                             decoded_token=lp.decoded_token) for t, lp in e.items()}
            for e in entries]

    def _logprobs(self, logprobs, text_offset: int) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for lp in logprobs:
            token = self.token_text(lp.token_id)
            out.tokens.append(token)
            out.token_logprobs.append(json_logprob(lp.logprob))
            top = {self.token_text(t): json_logprob(v)
                   for t, v in zip(lp.top_token_ids, lp.top_logprobs)}
            top.setdefault(token, json_logprob(lp.logprob))
            out.top_logprobs.append(top)
            out.text_offset.append(text_offset)
            text_offset += len(token)
        return out

    async def _stream(self, request: CompletionRequest, response_id: str,
                      streams: list, admission) -> AsyncIterator[str]:
        n = request.n
        cursors = [[StreamCursor() for _ in range(n)] for _ in streams]
        final_states: list[EngineRequestState | None] = [None] * len(streams)
        try:
            async for i, state in merge_streams(streams):
                final_states[i] = state
                for choice in state.choices:
                    chunk = self._chunk(request, response_id, state, choice, i * n + choice.index,
                                        cursors[i][choice.index])
                    if chunk is not None:
                        yield sse_event(chunk)
            if request.stream_options and request.stream_options.include_usage:
                yield sse_event(CompletionResponse(id=response_id, model=self.model_name,
                                                   choices=[], usage=self.usage(final_states)))
        except APIError as e:
            yield sse_event(e.body())
        finally:
            admission.release()
        yield SSE_DONE

    def _chunk(self, request: CompletionRequest, response_id: str, state: EngineRequestState,
               choice: ChoiceState, index: int, cursor: StreamCursor
               ) -> CompletionResponse | None:
        """The next chunk of one choice, or None if it has nothing new; advances `cursor`."""
        new = cursor.advance(choice)
        if new is None:
            return None
        logprobs = None
        if request.logprobs is not None:
            logprobs = self._logprobs(choice.logprobs[new.token_start:], cursor.token_text_offset)
            if logprobs.text_offset:  # the same offsets as the whole response's
                cursor.token_text_offset = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
        return CompletionResponse(id=response_id, model=self.model_name, choices=[
            CompletionChoice(
                index=index, text=choice.text[new.char_start:], logprobs=logprobs,
                finish_reason=choice.finish_reason, stop_reason=choice.stop_reason,
                token_ids=choice.token_ids[new.token_start:] if request.return_token_ids
                else None,
                prompt_token_ids=state.prompt_token_ids
                if request.return_token_ids and new.is_first else None)])
