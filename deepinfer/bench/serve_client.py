"""Open-loop load generator over HTTP/SSE for any OpenAI-compatible server (ours, vLLM, ...).

Each request is sent at its arrival time whether or not earlier ones have finished (open
loop), streamed, and timed at the client: first text chunk (TTFT), every chunk after it
(ITL), last chunk (E2E). A request succeeds when the server generated tokens (usage's
completion_tokens, else the output chunks), not when its text is non-empty: a completion can
be one token whose text is empty (a special token, or part of a character); its final chunk
then stands in for the first text chunk. Output lengths are forced with `max_tokens` +
vLLM's `ignore_eos` (unknown fields are ignored by servers without it). Prompts go as
token-id arrays to /v1/completions by default; `prompt_format="text"` sends detokenized text
instead (servers without token-id prompts, or /v1/chat/completions).
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from deepinfer.bench.latency_stats import RequestResult
from deepinfer.bench.workloads import BenchRequest


@dataclass(frozen=True)
class ClientConfig:
    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None  # None: the first model of /v1/models
    api_key: str | None = None
    endpoint: str = "completions"  # completions | chat
    prompt_format: str = "tokens"  # tokens | text
    ignore_eos: bool = True
    temperature: float = 0.0
    max_concurrency: int | None = None
    request_timeout_s: float = 6 * 3600.0
    show_progress: bool = True

    def __post_init__(self) -> None:
        if self.endpoint not in ("completions", "chat"):
            raise ValueError("endpoint must be completions or chat")
        if self.prompt_format not in ("tokens", "text"):
            raise ValueError("prompt_format must be tokens or text")
        if self.endpoint == "chat" and self.prompt_format == "tokens":
            raise ValueError("the chat endpoint needs prompt_format=text")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max_concurrency must be at least 1")

    @property
    def root_url(self) -> str:
        url = self.base_url.rstrip("/")
        return url[:-3] if url.endswith("/v1") else url


@dataclass(frozen=True)
class PrefixCacheCounters:
    queries: float
    hits: float


@dataclass
class BenchRun:
    model: str
    results: list[RequestResult]
    duration_s: float
    prefix_cache_before: PrefixCacheCounters | None
    prefix_cache_after: PrefixCacheCounters | None

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        """Server-side hit rate over this run (hit tokens / queried tokens), from /metrics."""
        if self.prefix_cache_before is None or self.prefix_cache_after is None:
            return None
        queries = self.prefix_cache_after.queries - self.prefix_cache_before.queries
        hits = self.prefix_cache_after.hits - self.prefix_cache_before.hits
        return hits / queries if queries > 0 else None


def parse_prefix_cache_counters(metrics_text: str) -> PrefixCacheCounters | None:
    """Sum `*:prefix_cache_queries_total` / `*:prefix_cache_hits_total` over all label sets
    (our `deepinfer:` names and vLLM's `vllm:` ones). None if the server has neither."""
    sums = {"queries": 0.0, "hits": 0.0}
    found = False
    for line in metrics_text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{", 1)[0]
        for key in sums:
            if name.endswith(f"prefix_cache_{key}_total"):
                try:
                    sums[key] += float(value)
                    found = True
                except ValueError:
                    pass
    return PrefixCacheCounters(sums["queries"], sums["hits"]) if found else None


class ServeClient:
    """HTTP side of the benchmark: one pooled httpx client for the whole run."""

    def __init__(self, config: ClientConfig,
                 detokenize: Callable[[list[int]], str] | None = None) -> None:
        if config.prompt_format == "text" and detokenize is None:
            raise ValueError("prompt_format=text needs a detokenize function")
        self.config = config
        self.detokenize = detokenize
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self.http = httpx.AsyncClient(
            headers=headers, timeout=httpx.Timeout(config.request_timeout_s, connect=30.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))

    async def close(self) -> None:
        await self.http.aclose()

    async def resolve_model(self) -> str:
        response = await self.http.get(f"{self.config.root_url}/v1/models")
        response.raise_for_status()
        served = [m["id"] for m in response.json().get("data", [])]
        if self.config.model is None:
            if not served:
                raise ValueError("the server lists no models; pass --model")
            return served[0]
        if served and self.config.model not in served:
            raise ValueError(f"model {self.config.model!r} is not served (served: {served})")
        return self.config.model

    async def scrape_prefix_cache(self) -> PrefixCacheCounters | None:
        try:
            response = await self.http.get(f"{self.config.root_url}/metrics", timeout=10.0)
        except httpx.HTTPError:
            return None
        if response.status_code != 200:
            return None
        return parse_prefix_cache_counters(response.text)

    def _payload(self, model: str, request: BenchRequest) -> tuple[str, dict]:
        cfg = self.config
        prompt = (request.prompt_token_ids if cfg.prompt_format == "tokens"
                  else self.detokenize(request.prompt_token_ids))
        body = {"model": model, "temperature": cfg.temperature, "stream": True,
                "stream_options": {"include_usage": True}, "max_tokens": request.output_len}
        if cfg.ignore_eos:
            body["ignore_eos"] = True
        if cfg.endpoint == "chat":
            content = prompt
            if request.images:  # images workload: each image as a PNG data URL, then the text
                from deepinfer.bench.synthetic_images import image_data_url
                content = [{"type": "image_url", "image_url": {"url": image_data_url(spec)}}
                           for spec in request.images] + [{"type": "text", "text": prompt}]
            body.update(messages=[{"role": "user", "content": content}],
                        max_completion_tokens=request.output_len)
            return f"{cfg.root_url}/v1/chat/completions", body
        body["prompt"] = prompt
        return f"{cfg.root_url}/v1/completions", body

    async def send(self, model: str, request: BenchRequest, run_start: float) -> RequestResult:
        if request.images and self.config.endpoint != "chat":
            raise ValueError("requests with images need the chat endpoint (--endpoint chat)")
        url, body = self._payload(model, request)
        result = RequestResult(success=False, prompt_len=len(request.prompt_token_ids))
        start = time.perf_counter()
        result.start_s = start - run_start
        last = start
        num_chunks = 0
        try:
            async with self.http.stream("POST", url, json=body) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")
                    result.error = f"HTTP {response.status_code}: {text[:300]}"
                    return result
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        result.error = str(chunk["error"])[:300]
                        return result
                    now = time.perf_counter()
                    if _chunk_text(chunk) or (result.ttft_s is None and _chunk_finished(chunk)):
                        num_chunks += 1
                        if result.ttft_s is None:
                            result.ttft_s = now - start
                        else:
                            result.itl_s.append(now - last)
                        result.token_times_s.append(now - run_start)
                        last = now
                    self._apply_usage(result, chunk.get("usage"))
        except (httpx.HTTPError, json.JSONDecodeError) as e:
            result.error = f"{type(e).__name__}: {e}"
            return result
        if not result.usage_reported:
            result.output_len = num_chunks
        result.success = result.output_len > 0
        if not result.success:
            result.error = "no output tokens"
            return result
        result.e2e_s = (last if result.ttft_s is not None else time.perf_counter()) - start
        return result

    @staticmethod
    def _apply_usage(result: RequestResult, usage: dict | None) -> None:
        if not usage:
            return
        result.usage_reported = True
        result.output_len = int(usage.get("completion_tokens") or 0)
        result.prompt_len = int(usage.get("prompt_tokens") or result.prompt_len)
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            result.cached_tokens = int(details["cached_tokens"])


def _chunk_finished(chunk: dict) -> bool:
    return any(c.get("finish_reason") for c in chunk.get("choices") or [])


def _chunk_text(chunk: dict) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


async def run_benchmark(config: ClientConfig, requests: list[BenchRequest],
                        detokenize: Callable[[list[int]], str] | None = None) -> BenchRun:
    """Send `requests` at their arrival times; wait for all; scrape /metrics around it."""
    client = ServeClient(config, detokenize)
    try:
        model = await client.resolve_model()
        before = await client.scrape_prefix_cache()
        progress = None
        if config.show_progress:
            from tqdm import tqdm
            progress = tqdm(total=len(requests), desc="requests", unit="req")
        semaphore = asyncio.Semaphore(config.max_concurrency or len(requests))

        async def one(request: BenchRequest) -> RequestResult:
            async with semaphore:
                result = await client.send(model, request, run_start)
            if progress is not None:
                progress.update(1)
            return result

        run_start = time.perf_counter()
        tasks = []
        for request in requests:
            delay = run_start + request.arrival_time_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(request)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - run_start
        if progress is not None:
            progress.close()
        after = await client.scrape_prefix_cache()
        return BenchRun(model, list(results), duration, before, after)
    finally:
        await client.close()
