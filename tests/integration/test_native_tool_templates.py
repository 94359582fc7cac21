"""The DeepSeek-V3 and Llama 3 tool formats over HTTP: one `deepinfer serve` of the default
model per family, with a chat template of that family written here (SmolLM2's own renders no
tools) and the family's `--tool-call-parser`. A conversation with tool calls and results
tokenizes exactly as transformers' apply_chat_template(..., tools=...) renders it from the
messages that family's users pass (DeepSeek's template joins the arguments in as the client's
JSON text; Llama 3's reads them as an object), and a required tool_choice still returns calls
whose arguments validate, streamed the same as whole."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.integration.serve_process import ServeProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

# DeepSeek-V3's own template, cut down to the parts tools touch (same markers, same string
# concatenation of a call's type, name and arguments).
DEEPSEEK_TEMPLATE = r"""{{ bos_token }}{%- if tools %}## Tools
{% for tool in tools %}### {{ tool.function.name }}
{{ tool.function | tojson }}
{% endfor %}{% endif %}
{%- for message in messages %}
{%- if message['role'] == 'system' %}{{ message['content'] }}
{%- elif message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}
{%- elif message['role'] == 'assistant' and message['tool_calls'] %}{{ '<｜Assistant｜>' }}
{%- if message['content'] %}{{ message['content'] }}{% endif %}{{ '<｜tool▁calls▁begin｜>' }}
{%- for tool in message['tool_calls'] %}{{ '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\n' + '```json' + '\n' + tool['function']['arguments'] + '\n' + '```' + '<｜tool▁call▁end｜>' }}
{%- endfor %}{{ '<｜tool▁calls▁end｜><｜end▁of▁sentence｜>' }}
{%- elif message['role'] == 'tool' %}{{ '<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜><｜tool▁outputs▁end｜>' }}
{%- else %}{{ '<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>' }}
{%- endif %}{%- endfor %}
{%- if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"""

# Llama 3.1's template, cut down likewise (JSON tool calls, results as the ipython role).
LLAMA3_TEMPLATE = r"""{{- bos_token }}
{%- if tools %}<|start_header_id|>system<|end_header_id|>

Environment: ipython
Respond with a JSON object {"name": function name, "parameters": dictionary of argument name and its value}.
{% for t in tools %}{{ t | tojson(indent=4) }}

{% endfor %}<|eot_id|>{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}
{%- set tool_call = message.tool_calls[0].function %}<|start_header_id|>assistant<|end_header_id|>

{{ '{"name": "' + tool_call.name + '", "parameters": ' }}{{ tool_call.arguments | tojson }}{{ "}" }}<|eot_id|>
{%- elif message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content | trim }}<|eot_id|>
{%- endif %}{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

FAMILIES = {"deepseek_v3": DEEPSEEK_TEMPLATE, "llama3_json": LLAMA3_TEMPLATE}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather forecast for a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"]}}}
ASK = [{"role": "user", "content": "What will the weather be in Paris for the next 3 days?"}]
# Non-canonical spacing on purpose: DeepSeek's template must show the client's own text.
ARGUMENTS = '{"city":  "Paris",\n "days": 3}'
CONVERSATION = ASK + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": ARGUMENTS}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / f"{request.param}.jinja"
    path.write_text(FAMILIES[request.param])
    server = ServeProcess("--dtype", "float32", "--kv-cache-memory", "128MiB", "--threads", "1",
                          "--max-model-len", "1024", "--chat-template", str(path),
                          "--enable-auto-tool-choice", "--tool-call-parser", request.param)
    server.wait_ready(timeout_s=900)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    yield request.param, client, client.models.list().data[0].id
    assert server.stop() == 0


def test_tool_conversation_tokenizes_as_transformers(family, default_model_source):
    name, client, model = family
    response = client.chat.completions.create(model=model, messages=CONVERSATION, tools=[WEATHER],
                                              max_tokens=2, temperature=0.0,
                                              extra_body={"return_token_ids": True})
    hf_messages = json.loads(json.dumps(CONVERSATION))
    if name == "llama3_json":  # transformers' convention: arguments as an object
        hf_messages[1]["tool_calls"][0]["function"]["arguments"] = json.loads(ARGUMENTS)
    tokenizer = default_model_source.load_tokenizer()
    want = tokenizer.apply_chat_template(hf_messages, tools=[WEATHER], chat_template=FAMILIES[name],
                                         add_generation_prompt=True, tokenize=False)
    assert "sunny, 21 C" in want and "get_weather" in want
    if name == "deepseek_v3":
        assert "<｜tool▁sep｜>get_weather\n```json\n" + ARGUMENTS in want
    assert response.prompt_token_ids == tokenizer.encode(want, add_special_tokens=False)


def test_required_tool_choice_is_enforced_and_streams_the_same(family):
    _, client, model = family
    kwargs = dict(model=model, messages=ASK, tools=[WEATHER], tool_choice="required",
                  parallel_tool_calls=False, max_tokens=100, temperature=0.0)
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    streamed: dict[int, dict] = {}
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                entry = streamed.setdefault(d.index, {"name": d.function.name, "arguments": ""})
                entry["arguments"] += d.function.arguments or ""
    assert [(s["name"], s["arguments"]) for _, s in sorted(streamed.items())] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls]
