"""Structured outputs and tool calling over HTTP, as a user runs them: ONE `deepinfer serve`
of the default model with a chat template that renders tools (written here, Hermes style:
SmolLM2's own has none), driven by the official `openai` client. json_schema outputs
validate (jsonschema), `chat.completions.parse` fills a pydantic model, a named and a
required tool_choice return calls whose arguments validate against the tool's schema, the
streamed deltas assemble to the non-streamed message, a conversation with tool calls and
results tokenizes exactly as transformers' apply_chat_template(..., tools=...), and bad specs
are 400s."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pydantic
import pytest

from tests.integration.serve_process import ServeProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

TOOLS_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}
{% endif %}You may call these functions, each as <tool_call>{"name": ..., "arguments": ...}</tool_call>:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' and tools %}
{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{% if message.content %}{{ message.content }}
{% endif %}
{%- for call in message.tool_calls %}<tool_call>{"name": {{ call.function.name | tojson }}, \
"arguments": {{ call.function.arguments | tojson }}}</tool_call>
{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather forecast for a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "days", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "timezone": {"type": "string", "maxLength": 24}}, "required": ["timezone"]}}}
ASK = [{"role": "user", "content": "What will the weather be in Paris for the next 3 days?"}]


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "tools.jinja"
    path.write_text(TOOLS_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def server(template_file):
    server = ServeProcess("--dtype", "float32", "--kv-cache-memory", "128MiB", "--threads", "1",
                          "--max-model-len", "1024", "--chat-template", str(template_file),
                          "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    server.wait_ready(timeout_s=900)
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def test_json_schema_response_format_validates(client, model):
    schema = WEATHER["function"]["parameters"]
    for seed in (0, 1):
        response = client.chat.completions.create(
            model=model, messages=ASK, max_tokens=80, temperature=1.0, seed=seed,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "forecast", "schema": schema, "strict": True}})
        choice = response.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)


class Forecast(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=24)
    days: int = pydantic.Field(ge=1, le=7)
    sunny: bool


def test_parse_fills_a_pydantic_model(client, model):
    completion = client.chat.completions.parse(model=model, messages=ASK, max_tokens=80,
                                               temperature=0.0, response_format=Forecast)
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Forecast) and 1 <= parsed.days <= 7


def test_completions_take_structured_outputs(client, model):
    out = client.completions.create(model=model, prompt="Is the sky blue? Answer:", max_tokens=8,
                                    temperature=1.0, seed=2, n=3,
                                    extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert all(c.text in ("yes", "no") for c in out.choices)


@pytest.mark.parametrize("tool_choice", [
    {"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_forced_tool_calls_validate_and_stream_the_same(client, model, tool_choice):
    kwargs = dict(model=model, messages=ASK, tools=[WEATHER, TIME], tool_choice=tool_choice,
                  max_tokens=100, temperature=0.0)
    response = client.chat.completions.create(**kwargs)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    if isinstance(tool_choice, dict):
        assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    streamed: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            assert not c.delta.content
            for d in c.delta.tool_calls or []:
                entry = streamed.setdefault(d.index, {"id": d.id, "name": d.function.name,
                                                      "arguments": ""})
                entry["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls"
    assert [(s["name"], s["arguments"]) for _, s in sorted(streamed.items())] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert all(s["id"] and s["id"].startswith("call_") for s in streamed.values())


def test_tool_conversation_tokenizes_as_transformers(client, model, default_model_source):
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris", "days": 3, "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    response = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER],
                                              max_tokens=4, temperature=0.0,
                                              extra_body={"return_token_ids": True})
    tokenizer = default_model_source.load_tokenizer()
    hf_messages = json.loads(json.dumps(messages))
    hf_messages[1]["tool_calls"][0]["function"]["arguments"] = json.loads(
        messages[1]["tool_calls"][0]["function"]["arguments"])  # transformers' convention
    want = tokenizer.apply_chat_template(hf_messages, tools=[WEATHER], chat_template=TOOLS_TEMPLATE,
                                         add_generation_prompt=True, tokenize=False)
    assert "<tool_call>" in want and "sunny, 21 C" in want
    assert response.prompt_token_ids == tokenizer.encode(want, add_special_tokens=False)


def test_tokenize_gives_the_ids_a_chat_request_is_given(client, server, model):
    """/tokenize renders the tool conversation exactly as /v1/chat/completions does, and
    /detokenize gives back the rendered text."""
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]
    response = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER],
                                              max_tokens=1, temperature=0.0,
                                              extra_body={"return_token_ids": True})
    tokenized = httpx.post(f"{server.url}/tokenize", json={
        "model": model, "messages": messages, "tools": [WEATHER], "return_token_strs": True},
        timeout=60).json()
    assert tokenized["tokens"] == response.prompt_token_ids
    assert tokenized["count"] == response.usage.prompt_tokens == len(tokenized["token_strs"])
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": tokenized["tokens"]},
                      timeout=60).json()["prompt"]
    assert "<tool_call>" in text and "rain" in text
    plain = httpx.post(f"{server.url}/tokenize", json={"prompt": text, "add_special_tokens": False},
                       timeout=60).json()
    assert plain["tokens"] == tokenized["tokens"]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}},
     "response_format"),
    ("/v1/chat/completions", {"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ("/v1/completions", {"guided_grammar": "root ::= missing"}, "guided_grammar"),
    ("/v1/completions", {"guided_json": "{oops"}, "guided_json"),
    ("/v1/chat/completions", {"response_format": {"type": "structural_tag", "triggers": ["<x"],
        "structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}]}},
     "response_format"),
    ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": {
        "type": "function", "function": {"name": "unknown"}}}, "tool_choice"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "required": "a"}}}]}, "tools"),
])
def test_bad_specs_are_400s(server, model, path, body, param):
    base = {"model": model, "max_tokens": 4}
    base.update({"messages": ASK} if "chat" in path else {"prompt": "hi"})
    response = httpx.post(f"{server.url}{path}", json={**base, **body}, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    ok = httpx.post(f"{server.url}/v1/completions", json={"model": model, "prompt": "hi",
                                                          "max_tokens": 2}, timeout=120)
    assert ok.status_code == 200


def test_prefix_completion_continues_the_message(client, model):
    messages = ASK + [{"role": "assistant", "content": "The forecast for Paris is", "prefix": True}]
    response = client.chat.completions.create(model=model, messages=messages, max_tokens=6,
                                              temperature=0.0, extra_body={"return_token_ids": True})
    tokenizer_text = response.prompt_token_ids
    assert response.choices[0].message.content  # the model went on writing
    plain = client.chat.completions.create(model=model, messages=messages[:1] + [
        {k: v for k, v in messages[1].items() if k != "prefix"}], max_tokens=1, temperature=0.0,
        extra_body={"return_token_ids": True})
    # The same conversation without prefix closes the turn and opens a new one: longer.
    assert plain.prompt_token_ids[:len(tokenizer_text)] == tokenizer_text
    assert len(plain.prompt_token_ids) > len(tokenizer_text)


def test_suffix_on_a_model_without_fim_tokens_is_a_400(server, model):
    response = httpx.post(f"{server.url}/v1/completions", json={
        "model": model, "prompt": "def f(", "suffix": "    return 1\n", "max_tokens": 4},
        timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "suffix"


def test_echo_returns_the_prompt_with_transformers_logprobs(server, model, hf_reference):
    import torch

    ids = hf_reference.encode("The capital of France is Paris, and the capital of Italy is")
    url = f"{server.url}/v1/completions"
    body = {"model": model, "prompt": ids, "max_tokens": 4, "temperature": 0.0}
    plain = httpx.post(url, json=body, timeout=120).json()["choices"][0]
    echoed = httpx.post(url, json={**body, "echo": True, "logprobs": 2}, timeout=120).json()
    choice = echoed["choices"][0]
    prompt_text = hf_reference.tokenizer.decode(ids)
    assert choice["text"] == prompt_text + plain["text"]
    lps = choice["logprobs"]
    assert len(lps["tokens"]) == len(ids) + 4 and lps["token_logprobs"][0] is None
    assert lps["top_logprobs"][0] is None
    with torch.inference_mode():
        want = torch.log_softmax(hf_reference.model(torch.tensor([ids])).logits[0, :-1].float(), -1)
    for pos in range(1, len(ids)):
        assert abs(lps["token_logprobs"][pos] - float(want[pos - 1, ids[pos]])) < 2e-3, pos
        assert len(lps["top_logprobs"][pos]) <= 3
    # streamed: the prompt comes in the first chunk, and the chunks add up to the whole
    with httpx.stream("POST", url, json={**body, "echo": True, "logprobs": 2, "stream": True},
                      timeout=120) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    texts = [c["choices"][0]["text"] for c in chunks]
    assert texts[0].startswith(prompt_text) and "".join(texts) == choice["text"]
    assert sum((c["choices"][0]["logprobs"]["token_logprobs"] for c in chunks), []) \
        == lps["token_logprobs"]
    only = httpx.post(url, json={**body, "echo": True, "max_tokens": 0}, timeout=120).json()
    assert only["choices"][0]["text"] == prompt_text and only["usage"]["completion_tokens"] == 0


def test_structural_tags_over_http(server, model):
    """vLLM's two ways to send one: response_format (the older shape, free text and a call the
    few-shot prompt leads to) and structured_outputs.structural_tag as JSON text (xgrammar's
    shape, the call forced first): 200s whose calls validate against the structure's schema."""
    from tests.integration.test_structural_tags import BEGIN, FEW_SHOT, FORCED, LEGACY, calls
    response = httpx.post(f"{server.url}/v1/completions", timeout=300, json={
        "model": model, "prompt": FEW_SHOT, "max_tokens": 40, "temperature": 0,
        "response_format": LEGACY})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert calls(choice["text"], choice["finish_reason"])[0] == {"city": "Paris", "days": 3}
    response = httpx.post(f"{server.url}/v1/chat/completions", timeout=300, json={
        "model": model, "messages": ASK, "max_tokens": 60, "temperature": 0,
        "structured_outputs": {"structural_tag": json.dumps(FORCED)}})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    text = choice["message"]["content"]
    assert text.startswith(BEGIN) and calls(text, choice["finish_reason"]), text
