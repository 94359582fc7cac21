"""`deepinfer serve --prefill-workers 1 --decode-workers 1` as a user runs it: a real server
process with one prefill and one decode worker process, driven over HTTP by the official
`openai` client; greedy outputs must equal the colocated offline engine token for token."""
from __future__ import annotations

import openai
import pytest

from deepinfer.sampling_params import SamplingParams
from tests.integration.serve_process import ServeProcess, metric, scrape_metrics

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away, there lived a king who",
           "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    store = tmp_path_factory.mktemp("kvstore")
    proc = ServeProcess("--dtype", "float32", "--threads", "1", "--num-kv-blocks", "256",
                        "--prefill-workers", "1", "--decode-workers", "1",
                        "--kv-store", f"fs://{store}")
    try:
        proc.wait_ready()
        yield proc
    finally:
        assert proc.stop() == 0, "server did not stop cleanly"


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
