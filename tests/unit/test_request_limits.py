"""Per-request caps on the real app over a fake engine: each over-the-cap request is a 4xx
naming its field before any engine work, the body cap is a 413 whether the size is declared
or not, the concurrency cap is a 429 with Retry-After, and preparation (templating,
tokenizing) runs off the event loop so other requests are served meanwhile."""
from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
from fastapi.testclient import TestClient

from deepinfer.server.api_server import ServerConfig, build_app
from deepinfer.server.request_limits import RequestLimits
from tests.unit.fake_engine_client import FakeEngineClient

PROMPT = "hello"


def app_client(**limits) -> tuple[TestClient, FakeEngineClient]:
    engine = FakeEngineClient()
    app = build_app(engine, ServerConfig(limits=RequestLimits(**limits)))
    return TestClient(app), engine


def completion(**fields) -> dict:
    return {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, **fields}


def chat(messages, **fields) -> dict:
    return {"messages": messages, "max_tokens": 3, **fields}


def deep(depth: int) -> list:
    """A list nested `depth` levels deep."""
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


def assert_refused(response, param: str, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    return error


@pytest.fixture(scope="module")
def http():
    client, engine = app_client()
    client.engine = engine
    return client


OVER_THE_CAP = [
    ("completions", completion(stop=[f"s{i}" for i in range(10_000)]), "stop"),
    ("completions", completion(stop=["x" * 5000]), "stop"),
    ("completions", completion(bad_words=[f"w{i}" for i in range(65)]), "bad_words"),
    ("completions", completion(prompt=[PROMPT] * 1000, n=128), "prompt"),
    ("completions", completion(prompt=[[11, 12]] * 1025), "prompt"),
    ("completions", completion(logit_bias={str(i): 1.0 for i in range(2000)}), "logit_bias"),
    ("completions", completion(stop_token_ids=[1] * 5000), "stop_token_ids"),
    ("completions", completion(vllm_xargs=deep(34)), "vllm_xargs"),
    ("chat/completions", chat([{"role": "user", "content": "hi"}] * 1025), "messages"),
    ("chat/completions", chat([{"role": "user", "content": [{"type": "text"}] * 1025}]),
     "messages"),
    ("chat/completions", chat([{"role": "user", "content": "hi", "x": deep(31)}]), "messages"),
]


@pytest.mark.parametrize("endpoint,body,param", OVER_THE_CAP,
                         ids=[f"{e}-{p}-{i}" for i, (e, _, p) in enumerate(OVER_THE_CAP)])
def test_a_request_over_a_cap_is_a_400_naming_the_field_and_never_reaches_the_engine(
        http, endpoint, body, param):
    before = len(http.engine.requests)
    error = assert_refused(http.post(f"/v1/{endpoint}", json=body), param)
    assert error["code"] == "limit_exceeded"
    assert len(http.engine.requests) == before


def test_requests_at_the_caps_are_served(http):
    r = http.post("/v1/completions", json=completion(stop=[f"s{i}" for i in range(64)],
                                                     prompt=[PROMPT] * 8, n=128))
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 8 * 128
    small, _ = app_client(max_content_parts=4, max_messages=2)
    parts = [{"type": "text", "text": "a"}]
    two_by_two = [{"role": "user", "content": parts * 2}] * 2
    assert small.post("/v1/chat/completions", json=chat(two_by_two)).status_code == 200
    assert_refused(small.post("/v1/chat/completions",
                              json=chat([{"role": "user", "content": parts * 5}])), "messages")
    assert_refused(small.post("/v1/chat/completions",
                              json=chat([{"role": "user", "content": "a"}] * 3)), "messages")


def test_the_image_count_is_checked_before_any_image_is_fetched():
    from deepinfer.server.request_limits import check_request
    from deepinfer.server.errors import APIError
    from deepinfer.server.protocol import ChatCompletionRequest

    part = {"type": "image_url", "image_url": {"url": "http://169.254.169.254/x.png"}}
    request = ChatCompletionRequest(messages=[{"role": "user", "content": [part] * 3}])
    with pytest.raises(APIError) as e:
        check_request(request, RequestLimits(max_images_per_request=2))
    assert e.value.status_code == 400 and "got 3" in str(e.value)
    check_request(request, RequestLimits(max_images_per_request=3))


def test_a_declared_body_over_the_cap_is_a_413_before_it_is_read():
    http, engine = app_client(max_request_body_bytes=1000)
    body = completion(prompt="a" * 2000)
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert http.post("/v1/completions", json=completion()).status_code == 200
    assert len(engine.requests) == 1


def test_an_undeclared_body_over_the_cap_is_a_413_too():
    http, engine = app_client(max_request_body_bytes=1000)

    def chunks():  # chunked transfer: no Content-Length to trust
        yield b'{"prompt": "'
        for _ in range(100):
            yield b"a" * 100
        yield b'"}'

    r = http.post("/v1/completions", content=chunks(),
                  headers={"Content-Type": "application/json"})
    assert r.status_code == 413, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert engine.requests == []


def test_the_concurrency_cap_answers_429_with_retry_after_and_frees_its_slot():
    async def scenario():
        engine = FakeEngineClient()
        engine.gate = asyncio.Event()
        app = build_app(engine, ServerConfig(limits=RequestLimits(max_concurrent_requests=1)))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test") as client:
            first = asyncio.create_task(client.post("/v1/completions", json=completion()))
            while not engine.requests:  # the first one holds the only slot
                await asyncio.sleep(0.01)
            refused = await client.post("/v1/completions", json=completion())
            health = await client.get("/health")
            engine.gate.set()
            served = await first
            again = await client.post("/v1/completions", json=completion())
        return refused, health, served, again

    refused, health, served, again = asyncio.run(scenario())
    assert refused.status_code == 429 and refused.headers["Retry-After"] == "1"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert health.status_code == 200  # not capped
    assert served.status_code == 200 and again.status_code == 200


def test_the_waiting_limit_429_carries_retry_after():
    engine = FakeEngineClient()
    engine.num_waiting_requests = 2
    http = TestClient(build_app(engine, ServerConfig(max_waiting_requests=2)))
    r = http.post("/v1/completions", json=completion())
    assert r.status_code == 429 and r.headers["Retry-After"] == "1"


def test_tokenizing_runs_off_the_event_loop():
    """While one request's tokenizer is blocked, another request is answered: were it run on
    the loop, the second could not be served until the first let go (the wait times out)."""
    async def scenario():
        engine = FakeEngineClient()
        release, entered, threads = threading.Event(), threading.Event(), []

        def on_encode(text: str) -> None:
            threads.append(threading.current_thread().name)
            if text == "slow":
                entered.set()
                assert release.wait(10), "the tokenizer was never released"

        engine.tokenizer.on_encode = on_encode
        app = build_app(engine, ServerConfig())
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test") as client:
            slow = asyncio.create_task(client.post("/v1/completions",
                                                   json=completion(prompt="slow")))
            while not entered.is_set():
                await asyncio.sleep(0.01)
            models = await client.get("/v1/models")  # served while the tokenizer is busy
            release.set()
            return models, await slow, threads

    models, slow, threads = asyncio.run(scenario())
    assert models.status_code == 200 and slow.status_code == 200
    assert threads and all(name.startswith("deepinfer-prepare") for name in threads)
    assert slow.json()["choices"][0]["text"] == FakeEngineClient().tokenizer.decode(
        FakeEngineClient().tokenizer.encode("slo"))


def test_cache_salt_reaches_the_engine():
    http, engine = app_client()
    assert http.post("/v1/completions", json=completion(cache_salt="t")).status_code == 200
    assert engine.requests[0][1].cache_salt == "t"


def test_a_prompt_far_over_the_context_is_refused_from_a_prefix():
    """Context 64, 2000 characters of one-token-per-character text: only a prefix is
    tokenized; a request that keeps the prompt's tail, or text that tokenizes densely, is
    tokenized whole and served as before."""
    from deepinfer.server.prompt_tokens import CHARS_PER_TOKEN_BOUND

    http, engine = app_client()
    seen: list[int] = []
    engine.tokenizer.on_encode = lambda text: seen.append(len(text))
    text = "abcdefghij" * 200
    error = assert_refused(http.post("/v1/completions", json=completion(prompt=text)), "prompt")
    assert error["code"] == "context_length_exceeded"
    assert seen == [64 * CHARS_PER_TOKEN_BOUND] and engine.requests == []

    seen.clear()
    r = http.post("/v1/completions", json=completion(prompt=text, truncate_prompt_tokens=10))
    assert r.status_code == 200 and seen == [len(text)]
    assert engine.requests[-1][0] == engine.tokenizer.encode(text)[-10:]

    class DenseTokenizer(type(engine.tokenizer)):
        def encode(self, text, add_special_tokens=True):  # one token per 100 characters
            return [11 + len(text[i:i + 100]) % 50 for i in range(0, len(text), 100)]

    engine.tokenizer = DenseTokenizer()
    r = http.post("/v1/completions", json=completion(prompt=text))
    assert r.status_code == 200
    assert engine.requests[-1][0] == engine.tokenizer.encode(text)
