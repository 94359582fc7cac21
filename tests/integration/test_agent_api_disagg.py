"""Agent fields through disaggregated serving (P=1/D=1 over HTTP, the default model in fp32):
a json_schema response, a structural tag and a required tool call give exactly the tokens the
colocated engine gives for the same constrained request (the prefill worker samples the first
token under the grammar, the decode worker carries the matcher on), and fields that need what
P/D does not return are a 400 naming them."""
from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from tests.integration.serve_process import running_server
from tests.integration.test_structural_tags import CHAT, FEW_SHOT, FORCED, LEGACY, tagged
from tests.integration.test_structured_outputs import PERSON, PROMPT, constrained

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def pd_server():
    with running_server("--dtype", "float32", "--threads", "1", "--num-kv-blocks", "256",
                        "--prefill-workers", "1", "--decode-workers", "1",
                        "--kv-store", "none") as server:
        yield server


def completion(url: str, **body) -> dict:
    r = httpx.post(f"{url}/v1/completions", timeout=300, json={
        "prompt": PROMPT, "temperature": 0, "return_token_ids": True, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


@pytest.mark.parametrize("max_tokens", [1, 120])  # the first token alone comes from prefill
def test_json_schema_on_p1_d1_equals_colocated(pd_server, engine_base_llm, max_tokens):
    want = engine_base_llm.generate([PROMPT], constrained(json=PERSON, max_tokens=max_tokens),
                                    use_tqdm=False)[0].outputs[0]
    got = completion(pd_server.url, max_tokens=max_tokens, structured_outputs={"json": PERSON})
    assert got["token_ids"] == list(want.token_ids)
    if max_tokens == 120:
        assert got["finish_reason"] == "stop"
        jsonschema.validate(json.loads(got["text"]), PERSON)


def test_regex_and_choice_on_p1_d1_equal_colocated(pd_server, engine_base_llm):
    for spec in ({"regex": r"(yes|no), because [a-z ]{5,30}\."}, {"choice": ["red", "blue"]}):
        want = engine_base_llm.generate([PROMPT], constrained(max_tokens=40, **spec),
                                        use_tqdm=False)[0].outputs[0]
        got = completion(pd_server.url, max_tokens=40, structured_outputs=spec)
        assert got["token_ids"] == list(want.token_ids), spec


def test_structural_tags_on_p1_d1_equal_colocated(pd_server, engine_base_llm):
    """Both shapes and both fields; max_tokens=1: the forced first token comes from prefill."""
    for tag, prompt, max_tokens, field in ((LEGACY, FEW_SHOT, 40, "response_format"),
                                           (FORCED, CHAT, 1, "response_format"),
                                           (FORCED, CHAT, 40, "structured_outputs")):
        want = engine_base_llm.generate([prompt], tagged(tag, max_tokens),
                                        use_tqdm=False)[0].outputs[0]
        body = {field: tag if field == "response_format" else {"structural_tag": json.dumps(tag)}}
        got = completion(pd_server.url, prompt=prompt, max_tokens=max_tokens, **body)
        assert got["token_ids"] == list(want.token_ids), (field, max_tokens)


def test_prompt_logprobs_on_p1_d1_are_a_400_naming_the_field(pd_server):
    for body, param in (({"echo": True, "logprobs": 1}, "echo"), ({"prompt_logprobs": 1},
                                                                  "prompt_logprobs")):
        r = httpx.post(f"{pd_server.url}/v1/completions", timeout=60,
                       json={"prompt": "Hello", "max_tokens": 2, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    echoed = completion(pd_server.url, prompt="Hello there", max_tokens=3, echo=True)
    assert echoed["text"].startswith("Hello there")
