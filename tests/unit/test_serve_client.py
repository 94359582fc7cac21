"""`bench serve`'s client judges success by generated tokens, not by non-empty text:
a one-token completion whose text is empty (a special token, or the first bytes of a
character) is a completed request. Streams are served by an in-process mock transport."""
from __future__ import annotations

import asyncio
import json

import httpx

from deepinfer.bench.latency_stats import summarize
from deepinfer.bench.serve_client import ClientConfig, ServeClient
from deepinfer.bench.workloads import BenchRequest


def sse(*chunks: dict) -> bytes:
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks).encode() + b"data: [DONE]\n\n"


def usage(completion_tokens: int) -> dict:
    return {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": completion_tokens,
                                     "total_tokens": 4 + completion_tokens}}


def completion(text: str, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}


def delta(finish: str | None = None, **d) -> dict:
    return {"choices": [{"index": 0, "delta": d, "finish_reason": finish}]}


def send(body: bytes, endpoint: str = "completions"):
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    async def go():
        fmt = "text" if endpoint == "chat" else "tokens"
        config = ClientConfig(endpoint=endpoint, prompt_format=fmt, show_progress=False)
        client = ServeClient(config, detokenize=lambda ids: "x" * len(ids))
        await client.http.aclose()
        client.http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        try:
            return await client.send("m", BenchRequest([1, 2, 3, 4], 1, 0.0), 0.0)
        finally:
            await client.close()

    return asyncio.run(go())


def test_one_token_completion_with_empty_text_succeeds():
    r = send(sse(completion("", "length"), usage(1)))
    assert r.success and r.error is None
    assert r.output_len == 1 and r.ttft_s is not None and r.e2e_s is not None
    summary = summarize([r], 1.0)
    assert (summary.num_completed, summary.num_failed, summary.total_output_tokens) == (1, 0, 1)
    assert summary.ttft_ms.count == 1


def test_one_token_chat_completion_with_empty_content_succeeds():
    r = send(sse(delta(role="assistant", content=""), delta("length", content=""), usage(1)),
             endpoint="chat")
    assert r.success and r.output_len == 1 and r.ttft_s is not None


def test_no_generated_tokens_is_a_failure():
    r = send(sse(completion("", "length"), usage(0)))
    assert not r.success and r.error == "no output tokens"
    r = send(sse(delta(role="assistant", content="")), endpoint="chat")  # no usage, no output
    assert not r.success and r.error == "no output tokens"


def test_text_chunks_time_ttft_and_itl():
    r = send(sse(completion("a"), completion(""), completion("b"), completion("c", "length"),
                 usage(4)))
    assert r.success and r.output_len == 4  # usage counts the empty-text token too
    assert r.ttft_s is not None and len(r.itl_s) == 2 and len(r.token_times_s) == 3
    # A final chunk with no text after the text ones adds no inter-token gap.
    r = send(sse(completion("a"), completion("b"), completion("", "stop"), usage(3)))
    assert len(r.itl_s) == 1 and r.output_len == 3


def test_without_usage_output_chunks_count():
    r = send(sse(completion("a"), completion("b", "length")))
    assert r.success and r.output_len == 2
