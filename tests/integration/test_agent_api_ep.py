"""Agent fields through expert-parallel serving, as a user runs it: `deepinfer serve
--data-parallel-size 2 --enable-expert-parallel` on a tiny random Qwen3-MoE with the default
model's tokenizer (and its full vocabulary, so text prompts and grammars over real tokens work).
Over HTTP: json_schema, regex and choice outputs give exactly the tokens of one plain engine on
the same checkpoint and validate, also when many constrained requests run on both ranks at
once (each rank masks its own rows, in line, while its peer steps with it); a required tool
call is grammar-enforced and equals the plain engine under the same grammar; and cache_salt
keeps tenants' prefixes apart on the ranks' prefix caches while outputs stay the same. And
with an EP=2 group as the disaggregated decode stage (P1, `--decode-data-parallel-size 2`),
concurrent constrained requests equal the plain engine too."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest

from deepinfer import SamplingParams
from tests.integration.moe_checkpoints import tiny_moe_model
from tests.integration.serve_process import ServeProcess
from tests.integration.test_agent_api_http import ASK, TIME, TOOLS_TEMPLATE, WEATHER
from tests.integration.test_structured_outputs import PERSON, PROMPT, constrained

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REGEX = r"(yes|no), because [a-z ]{5,30}\."
CHOICE = ["red", "blue"]
PROMPTS = [PROMPT, "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n",
           "Answer yes or no:"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, default_model_source):
    tokenizer = default_model_source.load_tokenizer()
    directory = tmp_path_factory.mktemp("moe")
    tiny_moe_model("qwen3_moe", seed=35, vocab_size=len(tokenizer)).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    (directory / "tools.jinja").write_text(TOOLS_TEMPLATE)
    return directory


@pytest.fixture(scope="module")
def reference(checkpoint):
    """One plain engine on the checkpoint (the tokens every EP answer must equal)."""
    from deepinfer import LLM
    return LLM(model=str(checkpoint), dtype="float32", seed=0, num_kv_blocks=128, num_threads=1)


@pytest.fixture(scope="module")
def ep_server(checkpoint):
    server = ServeProcess("--model", str(checkpoint), "--dtype", "float32", "--threads", "1",
                          "--num-kv-blocks", "128", "--data-parallel-size", "2",
                          "--enable-expert-parallel", "--enable-prompt-tokens-details",
                          "--chat-template", str(checkpoint / "tools.jinja"))
    try:
        server.wait_ready()
    except BaseException:
        server.stop()
        raise
    yield server
    assert server.stop() == 0, server.output()


def completion(url: str, **body) -> dict:
    r = httpx.post(f"{url}/v1/completions", timeout=300, json={
        "temperature": 0, "return_token_ids": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


def want_tokens(reference, prompts, **spec) -> list[list[int]]:
    outs = reference.generate(prompts, constrained(max_tokens=80, **spec), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_json_schema_regex_and_choice_equal_the_plain_engine(ep_server, reference):
    fields = [("json", {"response_format": {"type": "json_schema", "json_schema": {
                  "name": "person", "schema": PERSON, "strict": True}}}),
              ("regex", {"structured_outputs": {"regex": REGEX}}),
              ("choice", {"structured_outputs": {"choice": CHOICE}})]
    for kind, body in fields:
        spec = {"json": PERSON, "regex": REGEX, "choice": CHOICE}[kind]
        want = want_tokens(reference, PROMPTS, **{kind: spec})
        for prompt, tokens in zip(PROMPTS, want):
            choice = completion(ep_server.url, prompt=prompt, max_tokens=80, **body)["choices"][0]
            assert choice["token_ids"] == tokens, (kind, prompt)
            assert choice["finish_reason"] == "stop", choice["text"]
            if kind == "json":
                jsonschema.validate(json.loads(choice["text"]), PERSON)
            elif kind == "regex":
                assert re.fullmatch(REGEX, choice["text"]), choice["text"]
            else:
                assert choice["text"] in CHOICE


def test_concurrent_constrained_requests_on_both_ranks_equal_the_plain_engine(ep_server,
                                                                              reference):
    """Short (choice) and long (json, regex) constrained requests and unconstrained ones at
    once: the least-loaded router puts them on both ranks, so both maskers run, and a rank
    whose requests ended keeps stepping idle while the other still masks."""
    jobs = []
    for prompt in PROMPTS:
        jobs += [(prompt, "json", PERSON), (prompt, "regex", REGEX), (prompt, "choice", CHOICE),
                 (prompt, None, None)]
    want = []
    for prompt, kind, spec in jobs:
        params = (constrained(max_tokens=40, **{kind: spec}) if kind else
                  SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
        want.append(list(reference.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids))

    def send(job):
        prompt, kind, spec = job
        body = {"structured_outputs": {kind: spec}} if kind else {"ignore_eos": True}
        return completion(ep_server.url, prompt=prompt, max_tokens=40, **body)["choices"][0]

    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(send, jobs))
    assert [c["token_ids"] for c in got] == want
    for (_, kind, spec), choice in zip(jobs, got):
        if kind == "choice":
            assert choice["text"] in CHOICE
        elif kind == "regex" and choice["finish_reason"] == "stop":
            assert re.fullmatch(REGEX, choice["text"]), choice["text"]


def test_required_tool_call_is_enforced_and_equals_the_plain_engine(ep_server, reference,
                                                                    default_model_source):
    from deepinfer.server.protocol import ChatCompletionRequest
    from deepinfer.server.tool_calling import plan_tools

    r = httpx.post(f"{ep_server.url}/v1/chat/completions", timeout=300, json={
        "messages": ASK, "tools": [WEATHER, TIME], "tool_choice": "required",
        "parallel_tool_calls": False, "max_tokens": 100, "temperature": 0,
        "return_token_ids": True})
    assert r.status_code == 200, r.text
    response = r.json()
    choice = response["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    [call] = choice["message"]["tool_calls"]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])

    tokenizer = default_model_source.load_tokenizer()
    text = tokenizer.apply_chat_template(ASK, tools=[WEATHER, TIME], chat_template=TOOLS_TEMPLATE,
                                         add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer.encode(text, add_special_tokens=False)
    assert response["prompt_token_ids"] == prompt_ids
    grammar = plan_tools(ChatCompletionRequest(
        model="m", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
        parallel_tool_calls=False), None).structured
    want = reference.generate([{"prompt_token_ids": prompt_ids}], SamplingParams(
        temperature=0.0, max_tokens=100, structured_outputs=grammar), use_tqdm=False)[0].outputs[0]
    assert choice["token_ids"] == list(want.token_ids)


def test_cache_salt_isolates_tenants_on_the_ranks(ep_server, reference):
    prompt = [1000 + 7 * i for i in range(40)]  # two full 16-token blocks, unlike other tests'
    want = list(reference.generate([{"prompt_token_ids": prompt}], SamplingParams(
        temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids)

    def send(salt: str | None) -> int:
        body = {"prompt": prompt, "max_tokens": 6, "ignore_eos": True}
        if salt is not None:
            body["cache_salt"] = salt
        got = completion(ep_server.url, **body)
        assert got["choices"][0]["token_ids"] == want, salt
        return got["usage"]["prompt_tokens_details"]["cached_tokens"]

    # One request at a time on an idle group: each goes to the least loaded rank, ties to
    # rank 0, so all six meet one rank's prefix cache (isolation is by salt, not by rank).
    assert send("tenant-a") == 0
    assert send("tenant-b") == 0  # another tenant's prefix: no hit
    assert send(None) == 0  # nor for an unsalted request
    assert send("tenant-a") == 32  # the same tenant shares its prefix
    assert send("tenant-b") == 32
    assert send(None) == 32


def test_prompt_logprobs_on_ep_are_a_400_naming_the_field(ep_server):
    """The ranks do not return prompt log-probs: a 400 naming the field, never a silent drop."""
    for body, param in (({"echo": True, "logprobs": 1}, "echo"), ({"prompt_logprobs": 1},
                                                                  "prompt_logprobs")):
        r = httpx.post(f"{ep_server.url}/v1/completions", timeout=60,
                       json={"prompt": "Hello", "max_tokens": 2, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    echoed = completion(ep_server.url, prompt="Hello there", max_tokens=3, echo=True)
    assert echoed["choices"][0]["text"].startswith("Hello there")


@pytest.fixture(scope="module")
def pd_ep_server(checkpoint):
    """P1 and an EP=2 decode group: the prefill worker samples the first token under the
    grammar, the rank the decode router picked carries the matcher on."""
    server = ServeProcess("--model", str(checkpoint), "--dtype", "float32", "--threads", "1",
                          "--num-kv-blocks", "128", "--kv-store", "none",
                          "--prefill-workers", "1", "--decode-workers", "1",
                          "--decode-data-parallel-size", "2", "--enable-expert-parallel")
    try:
        server.wait_ready()
    except BaseException:
        server.stop()
        raise
    yield server
    assert server.stop() == 0, server.output()


def test_constrained_outputs_on_an_ep_decode_group_equal_the_plain_engine(pd_ep_server,
                                                                          reference):
    jobs = [(p, kind, spec) for p in PROMPTS
            for kind, spec in (("json", PERSON), ("regex", REGEX), ("choice", CHOICE))]
    want = [want_tokens(reference, [p], **{kind: spec})[0] for p, kind, spec in jobs]

    def send(job):
        prompt, kind, spec = job
        return completion(pd_ep_server.url, prompt=prompt, max_tokens=80,
                          structured_outputs={kind: spec})["choices"][0]

    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(send, jobs))
    assert [c["token_ids"] for c in got] == want
    for (_, kind, _), choice in zip(jobs, got):
        assert choice["finish_reason"] == "stop", choice["text"]
        if kind == "json":
            jsonschema.validate(json.loads(choice["text"]), PERSON)
