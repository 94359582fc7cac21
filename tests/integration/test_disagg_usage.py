"""`usage.prompt_tokens_details.cached_tokens` in disaggregated serving reports what the
prefill worker really reused (device or shared-store hits), as colocated serving does for the
same sequence: 0 on a cold start, the reused prefix on a repeat. One `deepinfer serve` with
P=2/D=1 per store kind (fs, redis); round-robin prefill routing sends each repeat to the other
prefill worker, so the reuse is a shared-store hit there."""
from __future__ import annotations

import contextlib
from pathlib import Path

import openai
import pytest

from deepinfer.core.prefix_hash import hash_request_blocks
from deepinfer.sampling_params import SamplingParams
from tests.integration.redis_server import running_redis_server
from tests.integration.serve_process import ServeProcess, wait_for_metric

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

BLOCK = 16


@pytest.fixture(scope="module", params=["fs", pytest.param("redis", marks=pytest.mark.redis)])
def served(request, tmp_path_factory):
    """(server, store kind, store location) for a P=2/D=1 cluster with round-robin prefill."""
    with contextlib.ExitStack() as stack:
        if request.param == "fs":
            location = str(tmp_path_factory.mktemp("kvstore"))
            url = f"fs://{location}"
        else:
            location = url = stack.enter_context(running_redis_server())
        proc = ServeProcess("--dtype", "float32", "--threads", "1", "--num-kv-blocks", "256",
                            "--prefill-workers", "2", "--decode-workers", "1",
                            "--prefill-router", "round-robin", "--kv-store", url,
                            "--enable-prompt-tokens-details")
        try:
            proc.wait_ready()
            yield proc, request.param, location
        finally:
            assert proc.stop() == 0, "server did not stop cleanly"


def _prompt(seed: int, length: int = 75) -> list[int]:
    return [1000 + (i * 7919 + seed * 104729) % 20000 for i in range(length)]


def _wait_stored(kind: str, location: str, prompt: list[int], harness_wait,
                 cache_salt: str | None = None) -> None:
    """Write-through is asynchronous: wait for every full block of `prompt` in the store."""
    hashes = [h.hex() for h in hash_request_blocks(prompt, BLOCK, cache_salt=cache_salt)]
    if kind == "fs":
        def stored() -> bool:
            return all(list(Path(location).glob(f"*/*/{h}*")) for h in hashes)
    else:
        import redis
        raw = redis.Redis.from_url(location)

        def stored() -> bool:
            return all(raw.keys(f"deepinfer:kv:*:{h}") for h in hashes)
    harness_wait(stored)


def _wait(predicate, timeout: float = 60.0) -> None:
    import time
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "prompt blocks never reached the store"
        time.sleep(0.05)


def _colocated_cached(make_engine_llm, prompt: list[int]) -> tuple[int, int]:
    """cached_tokens colocated serving reports for `prompt` cold, then repeated."""
    llm = make_engine_llm(num_kv_blocks=256)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    second = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    return first.num_cached_tokens, second.num_cached_tokens


def _cached(usage) -> int:
    details = usage.prompt_tokens_details
    return details.cached_tokens if details is not None else 0


def test_cached_tokens_cold_then_repeat(served, make_engine_llm):
    server, kind, location = served
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                           timeout=120)
    model = client.models.list().data[0].id
    seed = 1 if kind == "fs" else 2
    for streamed, prompt in ((False, _prompt(seed)), (True, _prompt(seed + 10, 83))):
        want_cold, want_repeat = _colocated_cached(make_engine_llm, prompt)
        assert (want_cold, want_repeat) == (0, (len(prompt) - 1) // BLOCK * BLOCK)
        got = []
        for attempt in range(2):  # round-robin: prefill-0 then prefill-1
            if streamed:
                stream = client.completions.create(
                    model=model, prompt=prompt, max_tokens=4, temperature=0, stream=True,
                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
                usage = [c.usage for c in stream if c.usage is not None]
                assert len(usage) == 1
                usage = usage[0]
            else:
                usage = client.completions.create(model=model, prompt=prompt, max_tokens=4,
                                                  temperature=0,
                                                  extra_body={"ignore_eos": True}).usage
            assert usage.prompt_tokens == len(prompt) and usage.completion_tokens == 4
            got.append(_cached(usage))
            if attempt == 0:
                _wait_stored(kind, location, prompt, _wait)
        assert got == [want_cold, want_repeat], (kind, streamed, got)
    # Hits by tier and early publishing are on /metrics: each repeat was a shared-store hit
    # on the worker that had not computed the prompt (no host tier configured here).
    hits = wait_for_metric(server.url, "deepinfer:cluster_prefix_hit_tokens_store_total",
                           lambda v: v >= 64 + 80)
    assert hits == 64 + 80
    assert wait_for_metric(server.url, "deepinfer:cluster_prefix_hit_tokens_host_total",
                           lambda v: v == 0) == 0
    assert wait_for_metric(server.url, "deepinfer:cluster_store_blocks_published_total",
                           lambda v: v >= 4 + 5) >= 4 + 5  # the cold prompts' full blocks


def test_cached_tokens_are_per_tenant(served):
    """cache_salt through P/D and the shared store: tenant A's prompt is cached for A only.
    Round-robin alternates the prefill workers, so A's repeat runs on the worker that never
    saw A (a store hit), and the unsalted and tenant-B requests between them miss on both."""
    server, kind, location = served
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                           timeout=120)
    model = client.models.list().data[0].id
    prompt = _prompt(3 if kind == "fs" else 4, 70)

    def cached(salt: str | None) -> int:
        body = {"ignore_eos": True} | ({"cache_salt": salt} if salt else {})
        usage = client.completions.create(model=model, prompt=prompt, max_tokens=2,
                                          temperature=0, extra_body=body).usage
        assert usage.prompt_tokens == len(prompt)
        return _cached(usage)

    assert cached("tenant-a") == 0
    _wait_stored(kind, location, prompt, _wait, cache_salt="tenant-a")
    got = {salt: cached(salt) for salt in (None, "tenant-b", "tenant-a")}
    assert got == {None: 0, "tenant-b": 0, "tenant-a": (len(prompt) - 1) // BLOCK * BLOCK}, kind
