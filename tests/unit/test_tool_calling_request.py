"""Chat requests with tools: tool_choice becomes the engine's grammar (required, named) or
the server's parser (auto); tools, tool calls and tool results reach the chat template; bad
tools, choices and templates are 400s. Then the output side: a choice's text becomes
`message.tool_calls` with finish_reason "tool_calls". Stub engine client, no model."""
from __future__ import annotations

import json

import jsonschema
import pytest

from deepinfer.server.chat_options import ChatOptions
from deepinfer.server.chat_output import ChatOutputParser
from deepinfer.server.errors import APIError
from deepinfer.server.protocol import ChatCompletionRequest
from deepinfer.server.serving_chat import OpenAIServingChat
from deepinfer.server.tool_calling import plan_tools
from deepinfer.server.tool_parsers import get_tool_parser
from tests.unit.test_api_request_fields import StubTokenizer, make

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer", "minimum": 1}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


class ToolTemplateTokenizer(StubTokenizer):
    """Records what the template was given; its template text mentions tools and tool_calls."""

    chat_template = "{% for tool in tools %}{% endfor %}{{ message.tool_calls }}"

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False, **kwargs):
        self.last = {"messages": messages, **kwargs}
        return super().apply_chat_template(messages, add_generation_prompt, tokenize)


def serving(tokenizer=None, **options) -> OpenAIServingChat:
    chat = make(OpenAIServingChat)
    chat.client.tokenizer = tokenizer or ToolTemplateTokenizer()
    chat.configure(ChatOptions(**options))
    return chat


def prepare(chat, messages=None, **fields):
    request = ChatCompletionRequest(messages=messages or [{"role": "user", "content": "hi"}],
                                    **fields)
    _, params, admission = chat._prepare(request)
    admission.release()
    return params


def error(chat, **fields) -> APIError:
    with pytest.raises(APIError) as info:
        prepare(chat, **fields)
    assert info.value.status_code == 400
    return info.value


def test_named_choice_constrains_to_the_function_parameters():
    chat = serving()
    params = prepare(chat, tools=[WEATHER, TIME],
                     tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(params.structured_outputs.json) == WEATHER["function"]["parameters"]
    assert [t["function"]["name"] for t in chat.client.tokenizer.last["tools"]] == [
        "get_weather", "get_time"]


@pytest.mark.parametrize("parallel", [None, False])
def test_required_choice_constrains_to_a_list_of_calls(parallel):
    params = prepare(serving(), tools=[WEATHER, TIME], tool_choice="required",
                     parallel_tool_calls=parallel)
    schema = json.loads(params.structured_outputs.json)
    good = [{"name": "get_weather", "parameters": {"city": "Paris"}},
            {"name": "get_time", "parameters": {}}]
    if parallel is False:
        good = good[:1]
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(good * 2, schema)
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "nope", "parameters": {}}],
                [{"name": "get_weather", "parameters": {"days": 2}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_auto_needs_the_parser_and_then_leaves_sampling_free():
    assert error(serving(), tools=[WEATHER]).info.param == "tool_choice"  # default is auto
    chat = serving(enable_auto_tool_choice=True, tool_call_parser="hermes")
    assert prepare(chat, tools=[WEATHER]).structured_outputs is None
    assert chat.client.tokenizer.last["tools"][0]["function"]["name"] == "get_weather"


def test_none_hides_the_tools():
    chat = serving()
    assert prepare(chat, tools=[WEATHER], tool_choice="none").structured_outputs is None
    assert "tools" not in chat.client.tokenizer.last


@pytest.mark.parametrize("fields,param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}},
     "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
])
def test_bad_tool_requests(fields, param):
    assert error(serving(), **fields).info.param == param


def test_a_template_without_tools_is_refused_unless_overridden():
    plain = StubTokenizer()
    e = error(serving(plain), tools=[WEATHER], tool_choice="required")
    assert e.info.param == "tools" and "--chat-template" in e.info.message
    overridden = serving(ToolTemplateTokenizer(), chat_template="{{ tools }} {{ tool_calls }}")
    prepare(overridden, tools=[WEATHER], tool_choice="required")
    assert overridden.client.tokenizer.last["chat_template"] == "{{ tools }} {{ tool_calls }}"


def test_tool_calls_and_results_reach_the_template():
    chat = serving()
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    prepare(chat, messages=messages, chat_template_kwargs={"enable_thinking": False})
    seen = chat.client.tokenizer.last
    assert seen["messages"][1]["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": {"city": "Paris"}}
    assert seen["messages"][2]["tool_call_id"] == "call_1"
    assert seen["enable_thinking"] is False
    bad = [messages[0], {**messages[1], "tool_calls": [
        {"id": "x", "function": {"name": "f", "arguments": "{oops"}}]}]
    assert "tool_calls" in error(chat, messages=bad).info.param
    assert error(chat, messages=[{"role": "tool", "content": "x"}]).info.param \
        == "messages[0].tool_call_id"
    assert error(serving(StubTokenizer()), messages=messages).info.param == "messages"


def output_parser(**fields) -> ChatOutputParser:
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)
    return ChatOutputParser(plan_tools(request, get_tool_parser("hermes")))


def test_outputs_become_tool_calls():
    named = output_parser(tools=[WEATHER], tool_choice={"type": "function",
                                                       "function": {"name": "get_weather"}})
    message, reason = named.message('{"city": "Rome"}', "stop")
    assert reason == "tool_calls" and message.content is None
    assert message.tool_calls[0].function.name == "get_weather"
    assert message.tool_calls[0].function.arguments == '{"city": "Rome"}'
    required = output_parser(tools=[WEATHER, TIME], tool_choice="required")
    message, reason = required.message(
        '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": '
        '{"city": "Oslo"}}]', "stop")
    assert [c.function.name for c in message.tool_calls] == ["get_time", "get_weather"]
    auto = output_parser(tools=[WEATHER])
    message, reason = auto.message("Sure.", "stop")
    assert (message.content, message.tool_calls, reason) == ("Sure.", None, "stop")
    message, reason = auto.message('<tool_call>{"name": "get_weather", "arguments": '
                                   '{"city": "Lima"}}</tool_call>', "length")
    assert reason == "length" and json.loads(message.tool_calls[0].function.arguments) == {
        "city": "Lima"}


@pytest.mark.parametrize("parser,keeps", [("deepseek_v3", True), ("hermes", False),
                                          ("llama3_json", False)])
def test_auto_keeps_special_tokens_where_the_markers_may_be_ones(parser, keeps):
    chat = serving(enable_auto_tool_choice=True, tool_call_parser=parser)
    assert prepare(chat, tools=[WEATHER]).skip_special_tokens is not keeps
    assert prepare(chat, tools=[WEATHER], skip_special_tokens=True).skip_special_tokens
    assert prepare(chat, tools=[WEATHER], tool_choice="none").skip_special_tokens


class JoiningTemplateTokenizer(ToolTemplateTokenizer):
    """Like DeepSeek's template: joins a call's arguments into the prompt as a string."""

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False, **kwargs):
        for m in messages:
            for call in m.get("tool_calls", []):
                "```json\n" + call["function"]["arguments"]  # TypeError on an object
        return super().apply_chat_template(messages, add_generation_prompt, tokenize, **kwargs)


def test_a_template_that_joins_arguments_as_text_gets_the_clients_text():
    tokenizer = JoiningTemplateTokenizer()
    text = '{"city":   "Paris"}'
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "get_weather", "arguments": text}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    prepare(serving(tokenizer), messages=messages, tools=[WEATHER], tool_choice="none")
    assert tokenizer.last["messages"][1]["tool_calls"][0]["function"]["arguments"] == text
    # a template that fails either way is still a 400 on the messages
    class Failing(JoiningTemplateTokenizer):
        def apply_chat_template(self, messages, *args, **kwargs):
            raise TypeError("broken template")
    assert error(serving(Failing()), messages=messages).info.param == "messages"
