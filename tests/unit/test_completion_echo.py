"""`echo` on /v1/completions behind the real app, on an engine stand-in that reports prompt
log-probs: the prompt's text (a token-id prompt's decoded text) before each choice's text,
the prompt tokens' logprobs before the generated ones (None for the first token), the same
assembled from the stream as whole, and max_tokens=0 giving the prompt alone."""
from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.testclient import TestClient

from deepinfer.core.scheduler_output import TokenLogprobs
from deepinfer.core.scheduler_output import Logprob
from deepinfer.server.api_server import ServerConfig, build_app
from deepinfer.wire.engine_messages import ChoiceDelta, RequestDelta
from tests.unit.fake_engine_client import VOCAB, FakeEngineClient


def prompt_entry(token: int, position: int, text) -> dict[int, Logprob]:
    """Position `position`'s entry: two alternatives ranked around the prompt token."""
    return {(token + 1) % VOCAB: Logprob(-0.25, 1, text((token + 1) % VOCAB)),
            token: Logprob(-0.5 - position, 2, text(token)),
            (token + 2) % VOCAB: Logprob(-3.0, 3, text((token + 2) % VOCAB))}


class EchoEngine(FakeEngineClient):
    """Answers with the prompt's first tokens (as the base), each with a log-prob, and the
    prompt log-probs on the first delta when asked for them."""

    supports_prompt_logprobs = True

    async def generate(self, request_id, prompt_token_ids, params, arrival_time=None,
                       mm_inputs=None):
        self.requests.append((list(prompt_token_ids), params))
        text = lambda t: self.tokenizer.decode([t])
        prompt_lps = None
        if params.prompt_logprobs is not None:
            prompt_lps = [None] + [prompt_entry(t, i, text)
                                   for i, t in enumerate(prompt_token_ids) if i > 0]
        tokens = [t % VOCAB for t in prompt_token_ids[:params.max_tokens]]
        for n, token in enumerate(tokens):
            last = n == len(tokens) - 1
            lp = TokenLogprobs(token, -1.0 - n, 1, [token], [-1.0 - n])
            yield RequestDelta(request_id, [ChoiceDelta(
                i, text(token), [token], [lp] if params.logprobs is not None else None,
                finish_reason="length" if last else None) for i in range(params.n)],
                finished=last, prompt_logprobs=prompt_lps if n == 0 else None)
            await asyncio.sleep(0)


@pytest.fixture
def app():
    engine = EchoEngine()
    return TestClient(build_app(engine, ServerConfig())), engine


def complete(http, **body):
    r = http.post("/v1/completions", json={"max_tokens": 3, **body})
    assert r.status_code == 200, r.text
    return r.json()


def streamed(http, **body) -> list[dict]:
    with http.stream("POST", "/v1/completions", json={"max_tokens": 3, "stream": True, **body}) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_echo_prepends_the_prompt(app):
    http, engine = app
    plain = complete(http, prompt="hello")["choices"][0]["text"]
    body = complete(http, prompt="hello", echo=True, n=2)
    assert [c["text"] for c in body["choices"]] == ["hello" + plain] * 2
    assert body["usage"]["completion_tokens"] == 6


def test_token_prompts_echo_their_decoded_text(app):
    http, engine = app
    ids = [40, 41, 42, 43]
    body = complete(http, prompt=[ids, [50, 51]], echo=True, max_tokens=1)
    texts = [c["text"] for c in body["choices"]]
    decode = engine.tokenizer.decode
    assert texts == [decode(ids) + decode(ids[:1]), decode([50, 51]) + decode([50])]


def test_echo_logprobs_put_the_prompt_first(app):
    http, engine = app
    body = complete(http, prompt="abcd", echo=True, logprobs=1)
    lps = body["choices"][0]["logprobs"]
    prompt = engine.tokenizer.encode("abcd")
    text = lambda t: engine.tokenizer.decode([t])
    assert engine.requests[-1][1].prompt_logprobs == 1
    assert lps["tokens"] == [text(t) for t in prompt] + [text(t) for t in prompt[:3]]
    assert lps["token_logprobs"] == [None, -1.5, -2.5, -3.5, -1.0, -2.0, -3.0]
    assert lps["top_logprobs"][0] is None
    # top 1 is the rank-1 alternative; the prompt token itself is always listed
    assert lps["top_logprobs"][1] == {text(prompt[1] + 1): -0.25, text(prompt[1]): -1.5}
    assert lps["text_offset"] == list(range(7))  # one character per token


def test_max_tokens_zero_echoes_the_prompt_only(app):
    http, engine = app
    body = complete(http, prompt="abc", echo=True, max_tokens=0, logprobs=0)
    choice = body["choices"][0]
    assert choice["text"] == "abc" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["token_logprobs"] == [None, -1.5, -2.5]
    assert body["usage"]["completion_tokens"] == 0
    chunks = streamed(http, prompt="abc", echo=True, max_tokens=0)
    assert [c["choices"][0]["text"] for c in chunks] == ["abc"]
    r = http.post("/v1/completions", json={"prompt": "abc", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert r.json()["error"]["code"] == "invalid_value"  # as pydantic's range checks say


@pytest.mark.parametrize("logprobs", [None, 2])
def test_stream_sends_the_prompt_first_and_assembles_to_the_whole(app, logprobs):
    http, engine = app
    body = dict(prompt="hello", echo=True, logprobs=logprobs)
    whole = complete(http, **body)["choices"][0]
    chunks = streamed(http, **body)
    first = chunks[0]["choices"][0]["text"]
    assert first.startswith("hello")
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    if logprobs is not None:
        joined = {k: sum((c["choices"][0]["logprobs"][k] for c in chunks), [])
                  for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
        assert joined == {k: whole["logprobs"][k] for k in joined}


def test_prompt_logprobs_keep_their_own_count_next_to_echo_logprobs(app):
    http, engine = app
    body = complete(http, prompt="abc", echo=True, logprobs=2, prompt_logprobs=0)
    assert engine.requests[-1][1].prompt_logprobs == 2
    entries = body["choices"][0]["prompt_logprobs"]
    prompt = engine.tokenizer.encode("abc")
    assert entries[0] is None
    assert [list(map(int, e)) for e in entries[1:]] == [[t] for t in prompt[1:]]


def test_echo_with_suffix_is_a_400(app):
    http, _ = app
    r = http.post("/v1/completions", json={"prompt": "a", "suffix": "b", "echo": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"


def test_a_client_without_prompt_logprobs_refuses_them_by_name():
    class NoPromptLogprobs(EchoEngine):
        supports_prompt_logprobs = False

    engine = NoPromptLogprobs()
    http = TestClient(build_app(engine, ServerConfig()))
    for body, param in (({"echo": True, "logprobs": 1}, "echo"), ({"prompt_logprobs": 1},
                                                                  "prompt_logprobs")):
        r = http.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert engine.requests == []
    r = http.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2, "echo": True})
    assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith("abc")
