"""Cached-token counts only with --enable-prompt-tokens-details (they reveal other tenants'
prefixes), a JSON /health in both states, and serve's default waiting limit."""
from __future__ import annotations

import json

import msgspec
from fastapi.testclient import TestClient

from deepinfer.server.api_server import ServerConfig, build_app
from tests.unit.fake_engine_client import FakeEngineClient


class CachingEngineClient(FakeEngineClient):
    """Reports 4 cached prompt tokens on the last delta of every request."""

    async def generate(self, *args, **kwargs):
        async for delta in super().generate(*args, **kwargs):
            yield msgspec.structs.replace(delta, num_cached_tokens=4) if delta.finished else delta


def usage_of(config: ServerConfig, path: str, body: dict) -> dict:
    r = TestClient(build_app(CachingEngineClient(), config)).post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


COMPLETION = ("/v1/completions", {"prompt": "hello world", "max_tokens": 3})
CHAT = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi there"}],
                                 "max_tokens": 3})


def test_cached_tokens_are_reported_only_when_enabled():
    for path, body in (COMPLETION, CHAT):
        off = usage_of(ServerConfig(), path, body)
        assert off.get("prompt_tokens_details") is None and off["prompt_tokens"] > 0
        on = usage_of(ServerConfig(enable_prompt_tokens_details=True), path, body)
        assert on["prompt_tokens_details"] == {"cached_tokens": 4}
        assert {k: on[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")} == \
            {k: off[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


def test_streamed_usage_follows_the_same_switch():
    path, body = COMPLETION
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    for enabled, want in ((False, None), (True, {"cached_tokens": 4})):
        http = TestClient(build_app(CachingEngineClient(),
                                    ServerConfig(enable_prompt_tokens_details=enabled)))
        lines = [line for line in http.post(path, json=body).text.splitlines()
                 if line.startswith("data: {")]
        usage = json.loads(lines[-1][6:])["usage"]
        assert usage.get("prompt_tokens_details") == want


def test_health_is_json_when_up_and_when_down():
    engine = FakeEngineClient()
    http = TestClient(build_app(engine, ServerConfig()))
    r = http.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    engine.is_healthy = False
    r = http.get("/health")
    assert r.status_code == 503 and r.json() == {"status": "unavailable"}


def test_serve_has_a_default_waiting_limit_and_zero_lifts_it():
    import argparse

    from deepinfer.cli.serve import DEFAULT_MAX_WAITING, register
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    assert parser.parse_args(["serve"]).max_waiting_requests == DEFAULT_MAX_WAITING > 0
    assert parser.parse_args(["serve", "--max-waiting-requests", "0"]).max_waiting_requests == 0


def test_openapi_documents_both_health_statuses():
    schema = TestClient(build_app(FakeEngineClient(), ServerConfig())).get("/openapi.json").json()
    assert {"200", "503"} <= set(schema["paths"]["/health"]["get"]["responses"])


def test_a_wrong_method_is_a_405_that_says_which_methods_the_path_takes():
    http = TestClient(build_app(FakeEngineClient(), ServerConfig()))
    r = http.get("/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["error"]["type"] == "invalid_request_error"
    r = http.post("/health")
    assert r.status_code == 405 and r.headers["allow"] == "GET"
