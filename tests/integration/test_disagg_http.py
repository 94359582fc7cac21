"""`deepinfer serve --prefill-workers 1 --decode-workers 1` as a user runs it: a real server
process with one prefill and one decode worker process, driven over HTTP by the official
`openai` client; greedy outputs must equal the colocated offline engine token for token.

Its workers raise inside a step for requests with a debug seed (`DebugStepFault`: one seed
for the prefill worker, one for the decode worker): such a request fails alone with a clear
500 / SSE error while the requests batched with it finish with their fault-free output, and no
worker is restarted."""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from deepinfer.sampling_params import SamplingParams
from tests.integration.engine_checks import token_prompts
from tests.integration.serve_process import (OfflineReference, metric, running_server,
                                             scrape_metrics)
from tests.integration.test_step_faults import PROMPT_A, _failures, _stream

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away, there lived a king who",
           "1, 2, 3, 4,"]


PREFILL_FAULT_SEED, DECODE_FAULT_SEED = 31337, 31338
FAULT_ENV = {"DEEPINFER_DEBUG_STEP_FAULT_SEED":
             f"prefill:{PREFILL_FAULT_SEED},decode:{DECODE_FAULT_SEED}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    store = tmp_path_factory.mktemp("kvstore")
    with running_server("--dtype", "float32", "--threads", "1", "--num-kv-blocks", "256",
                        "--prefill-workers", "1", "--decode-workers", "1",
                        "--kv-store", f"fs://{store}", env=FAULT_ENV) as proc:
        yield proc


def test_p1_d1_greedy_equals_colocated_engine(server, engine_base_llm):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    tok = engine_base_llm.get_tokenizer()
    for prompt in PROMPTS:
        ids = tok(prompt).input_ids
        got = client.completions.create(model=model, prompt=ids, max_tokens=16, temperature=0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
        want = engine_base_llm.generate(
            [{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=16,
                                                        ignore_eos=True), use_tqdm=False)[0]
        assert got.choices[0].token_ids == want.outputs[0].token_ids, prompt
        assert got.choices[0].text == want.outputs[0].text
    # Streaming goes through the same prefill -> KV transfer -> decode path.
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8,
        temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    want = engine_base_llm.chat([{"role": "user", "content": "Say hello."}],
                                SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert text == want.outputs[0].text
    samples = scrape_metrics(server.url)
    assert any(k.startswith("deepinfer:cluster_") for k in samples), "per-worker metrics missing"
    assert metric(samples, "deepinfer:generation_tokens_total") >= 3 * 16


def test_prompt_larger_than_the_decode_cache_is_a_400_not_a_wait(server):
    # The workers hold 256 blocks of 16 tokens; the model's context is longer than that.
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                           timeout=60)
    model = client.models.list().data[0].id
    prompt = [1000 + i % 1000 for i in range(256 * 16 + 10)]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt=prompt, max_tokens=4)
    # Workers cap max_model_len at what their cache holds, so the front refuses it by context
    # length; a decode cache smaller than the prefill side's is refused by its own check.
    assert "4096 tokens" in str(info.value)
    # The server still serves.
    ok = client.completions.create(model=model, prompt=prompt[:20], max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens == 2


LONG = {"prompt": PROMPT_A, "max_tokens": 24, "ignore_eos": True, "temperature": 0,
        "return_token_ids": True}


async def _faults_among_others(url: str, model: str) -> dict:
    """Two greedy streams decoding; then, blocking and streamed, a request whose prefill step
    fails and one whose decode step fails (after its first token came from prefill)."""
    body = {**LONG, "model": model}
    faulty = {role: {**body, "max_tokens": 6, "seed": seed}
              for role, seed in (("prefill", PREFILL_FAULT_SEED), ("decode", DECODE_FAULT_SEED))}
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        started = asyncio.Event()
        others = [asyncio.create_task(_stream(http, body, started)) for _ in range(2)]
        await asyncio.wait_for(started.wait(), 120)
        runs = await asyncio.gather(*[call for f in faulty.values() for call in (
            http.post("/v1/completions", json=f), _stream(http, f, asyncio.Event()))])
        seen = {"others": await asyncio.gather(*others)}
        for i, role in enumerate(faulty):
            blocking, (tokens, events) = runs[2 * i], runs[2 * i + 1]
            seen[role] = (blocking.status_code, blocking.json(), tokens, events)
        return seen


def test_a_failing_worker_step_fails_only_its_request(server, engine_base_llm):
    url = server.url
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    expected = OfflineReference(engine_base_llm).generate(
        token_prompts([PROMPT_A]), SamplingParams(temperature=0.0, max_tokens=24,
                                                  ignore_eos=True))[0].outputs[0].token_ids
    before = scrape_metrics(url)

    seen = asyncio.run(_faults_among_others(url, model))

    for role in ("prefill", "decode"):
        status, body, tokens, events = seen[role]
        assert status == 500 and body["error"]["code"] == "request_failed", (role, body)
        assert "injected fault" in body["error"]["message"], body
        assert "other requests were not affected" in body["error"]["message"]
        assert events[-1]["error"]["code"] == "request_failed", (role, events)
        # The decode worker's victim had its first token from the prefill worker.
        assert len(tokens) == (0 if role == "prefill" else 1), (role, tokens)
    for token_ids, events in seen["others"]:
        assert token_ids == expected
        assert events[-1]["choices"][0]["finish_reason"] == "length"
    after = scrape_metrics(url)
    assert _failures(after, "request") - _failures(before, "request") == 4
    for role in ("prefill", "decode"):
        name = "deepinfer:cluster_engine_step_failures_total"
        failed = {k: v - before.get(k, 0.0) for k, v in after.items()
                  if k.startswith(name + "{") and f'role="{role}"' in k}
        assert sum(failed.values()) >= 1, (role, failed)
    assert metric(after, "deepinfer:engine_step_failures_total") >= \
        metric(before, "deepinfer:engine_step_failures_total") + 2
    assert metric(after, "deepinfer:cluster_worker_restarts_total") == \
        metric(before, "deepinfer:cluster_worker_restarts_total")  # no worker went down
    again = httpx.post(f"{url}/v1/completions", json={**LONG, "model": model},
                       timeout=120).json()
    assert again["choices"][0]["token_ids"] == expected
