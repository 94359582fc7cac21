"""POST /v1/completions: text or token-id prompts (one or many), streamed or not.

Prompt i with n choices becomes engine request `{id}-{i}`; its choice j is reported as
`index = i * n + j`, as OpenAI and vLLM do.

`echo` (OpenAI/vLLM): each choice's text starts with its prompt's text (a token-id prompt's
decoded text), in the first chunk when streaming; with `logprobs` the prompt tokens' entries
come first (None for the first token, which nothing predicts). `max_tokens=0` with echo
returns the prompt only: the engine runs the prompt (and samples one token, dropped).
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
        if request.max_tokens == 0 and not request.echo:
            raise bad_request("max_tokens must be at least 1 (0 only with echo)",
                              param="max_tokens", code="invalid_value")
        if request.echo and request.suffix:
            raise bad_request("echo and suffix cannot be used together", param="echo")
        if request.best_of is not None and request.best_of != request.n:
            raise bad_request("best_of other than n is not supported", param="best_of",
                              code="unsupported_parameter")
        if request.prompt_logprobs is not None and request.stream:
            raise bad_request("prompt_logprobs are not available when stream is true",
                              param="prompt_logprobs")
        prompts = self._prompts(request)
        max_tokens = 1 if request.max_tokens == 0 else request.max_tokens
        prompt_logprobs = request.prompt_logprobs
        if request.echo and request.logprobs is not None:
            prompt_logprobs = max(request.logprobs, prompt_logprobs or 0)
        if prompt_logprobs is not None and not getattr(self.client, "supports_prompt_logprobs",
                                                       False):
            param = "prompt_logprobs" if request.prompt_logprobs is not None else "echo"
            raise bad_request("prompt log-probs (prompt_logprobs, or echo with logprobs) are "
                              "only available in colocated serving", param=param,
                              code="unsupported_parameter")
        params = [self.make_sampling_params(
            request, self.resolve_max_tokens(len(p), max_tokens), request.logprobs,
            prompt_logprobs) for p in prompts]
        return prompts, params, self.admit(len(prompts))

    def _echo_texts(self, request: CompletionRequest, prompts: list[list[int]]) -> list[str]:
        """What each prompt's choices start with under echo: a text prompt as sent (unless
        truncated), else the decoded prompt tokens."""
        sent = request.prompt if isinstance(request.prompt, list) else [request.prompt]
        if sent and isinstance(sent[0], int):
            sent = [sent]
        return [s if isinstance(s, str) and request.truncate_prompt_tokens is None
                else self.client.tokenizer.decode(p) for s, p in zip(sent, prompts)]

    async def create(self, request: CompletionRequest):
        """A CompletionResponse, or an async iterator of SSE strings when streaming."""
        prompts, params, admission = await self.prepare_off_loop(self._prepare, request)
        response_id = random_id("cmpl")
        echoes = self._echo_texts(request, prompts) if request.echo else [""] * len(prompts)
        streams = [self.submit(f"{response_id}-{i}", p, sp, admission)
                   for i, (p, sp) in enumerate(zip(prompts, params))]
        if request.stream:
            return self._stream(request, response_id, streams, admission, echoes)
        states: list[EngineRequestState | None] = [None] * len(streams)
        try:
            async for i, state in merge_streams(streams):
                states[i] = state
        finally:
            admission.release()
        if request.echo and request.max_tokens == 0:
            for state in states:
                _drop_generated(state)
        choices = [self._choice(request, state, choice, i * request.n + choice.index, echoes[i])
                   for i, state in enumerate(states) for choice in state.choices]
        return CompletionResponse(id=response_id, model=self.model_name, choices=choices,
                                  usage=self.usage(states))

    def _choice(self, request: CompletionRequest, state: EngineRequestState,
                choice: ChoiceState, index: int, echo: str = "") -> CompletionChoice:
        logprobs = None
        if request.logprobs is not None:
            logprobs = self._echo_logprobs(request, state)
            offset = _end_offset(logprobs) if logprobs is not None else 0
            logprobs = _joined(logprobs, self._logprobs(choice.logprobs, offset))
        return CompletionChoice(
            index=index, text=echo + choice.text, finish_reason=choice.finish_reason,
            stop_reason=choice.stop_reason, logprobs=logprobs,
            token_ids=choice.token_ids if request.return_token_ids else None,
            prompt_token_ids=state.prompt_token_ids if request.return_token_ids else None,
            prompt_logprobs=self._prompt_logprobs(state, request.prompt_logprobs)
            if request.prompt_logprobs is not None else None)

    @staticmethod
    def _prompt_logprobs(state: EngineRequestState, k: int
                         ) -> list[dict[int, PromptLogprob] | None] | None:
        """vLLM's prompt_logprobs: the prompt token and the top `k` at each position (the
        engine may have computed more alternatives, for echo's logprobs)."""
        entries = state.prompt_logprobs
        if entries is None:
            return None
        return [None if e is None else {
            t: PromptLogprob(logprob=json_logprob(lp.logprob), rank=lp.rank,
                             decoded_token=lp.decoded_token) for t, lp in e.items()
            if t == token or (lp.rank is not None and lp.rank <= k)}
            for e, token in zip(entries, state.prompt_token_ids)]

    def _echo_logprobs(self, request: CompletionRequest, state: EngineRequestState
                       ) -> CompletionLogprobs | None:
        """The prompt tokens' part of an echoed choice's logprobs (None without echo)."""
        if not request.echo:
            return None
        entries = state.prompt_logprobs
        if entries is None or len(entries) != len(state.prompt_token_ids):
            raise APIError(500, "the engine returned no prompt log-probs for echo",
                           type="server_error")
        out, offset = CompletionLogprobs(), 0
        for token_id, entry in zip(state.prompt_token_ids, entries):
            token = self.token_text(token_id)
            out.tokens.append(token)
            out.text_offset.append(offset)
            offset += len(token)
            if entry is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(json_logprob(entry[token_id].logprob))
            top = {self.token_text(t): json_logprob(lp.logprob) for t, lp in entry.items()
                   if lp.rank is not None and lp.rank <= request.logprobs}
            top.setdefault(token, json_logprob(entry[token_id].logprob))
            out.top_logprobs.append(top)
        return out

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
                      streams: list, admission, echoes: list[str]) -> AsyncIterator[str]:
        n = request.n
        cursors = [[StreamCursor() for _ in range(n)] for _ in streams]
        final_states: list[EngineRequestState | None] = [None] * len(streams)
        echo_only = request.echo and request.max_tokens == 0
        try:
            async for i, state in merge_streams(streams):
                final_states[i] = state
                if echo_only:
                    if not state.finished:
                        continue  # the prompt alone goes out once the engine is done
                    _drop_generated(state)
                for choice in state.choices:
                    chunk = self._chunk(request, response_id, state, choice, i * n + choice.index,
                                        cursors[i][choice.index], echoes[i])
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
               choice: ChoiceState, index: int, cursor: StreamCursor, echo: str = ""
               ) -> CompletionResponse | None:
        """The next chunk of one choice, or None if it has nothing new; advances `cursor`.
        The first chunk carries the echoed prompt."""
        new = cursor.advance(choice)
        if new is None:
            return None
        logprobs = None
        if request.logprobs is not None:
            prompt_part = self._echo_logprobs(request, state) if new.is_first else None
            if prompt_part is not None:
                cursor.token_text_offset = _end_offset(prompt_part)
            logprobs = _joined(prompt_part, self._logprobs(choice.logprobs[new.token_start:],
                                                           cursor.token_text_offset))
            if logprobs.text_offset:  # the same offsets as the whole response's
                cursor.token_text_offset = _end_offset(logprobs)
        text = choice.text[new.char_start:]
        return CompletionResponse(id=response_id, model=self.model_name, choices=[
            CompletionChoice(
                index=index, text=echo + text if new.is_first else text, logprobs=logprobs,
                finish_reason=choice.finish_reason, stop_reason=choice.stop_reason,
                token_ids=choice.token_ids[new.token_start:] if request.return_token_ids
                else None,
                prompt_token_ids=state.prompt_token_ids
                if request.return_token_ids and new.is_first else None)])


def _drop_generated(state: EngineRequestState) -> None:
    """max_tokens=0 with echo: forget the one token the engine had to sample."""
    for choice in state.choices:
        choice.text, choice.token_ids, choice.logprobs = "", [], []
        choice.finish_reason, choice.stop_reason = "length", None


def _end_offset(logprobs: CompletionLogprobs) -> int:
    if not logprobs.text_offset:
        return 0
    return logprobs.text_offset[-1] + len(logprobs.tokens[-1])


def _joined(first: CompletionLogprobs | None, second: CompletionLogprobs) -> CompletionLogprobs:
    if first is None:
        return second
    return CompletionLogprobs(
        text_offset=first.text_offset + second.text_offset,
        token_logprobs=first.token_logprobs + second.token_logprobs,
        tokens=first.tokens + second.tokens, top_logprobs=first.top_logprobs + second.top_logprobs)
