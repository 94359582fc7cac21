"""Hostile values in the agent fields (structured outputs, tools, tool_choice, template
kwargs, prefix) give a prepared request or a 400 (or pydantic's validation error, which the
app turns into a 400), never another exception. Hypothesis over arbitrary JSON values."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from deepinfer.server.errors import APIError
from deepinfer.server.protocol import ChatCompletionRequest, CompletionRequest
from deepinfer.server.serving_chat import OpenAIServingChat
from deepinfer.server.serving_completion import OpenAIServingCompletion
from tests.unit.test_api_request_fields import make
from tests.unit.test_tool_calling_request import ToolTemplateTokenizer

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-10 ** 20, 10 ** 20) | st.floats(allow_nan=True)
    | st.text(max_size=20) | st.sampled_from(["object", "string", "array", "function", "type",
                                              "json_schema", "json_object", "required", "auto"]),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.sampled_from(["type", "json_schema", "schema", "name", "function",
                                       "parameters", "properties", "items", "regex", "choice",
                                       "json", "grammar", "enum", "prefix", "x"]),
                      children, max_size=4),
    max_leaves=20)
FIELDS = ["response_format", "structured_outputs", "guided_json", "guided_regex",
          "guided_choice", "guided_grammar", "tools", "tool_choice", "parallel_tool_calls",
          "chat_template_kwargs", "continue_final_message"]


def chat_serving():
    chat = make(OpenAIServingChat)
    chat.client.tokenizer = ToolTemplateTokenizer()
    return chat


CHAT, COMPLETION = chat_serving(), make(OpenAIServingCompletion)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(FIELDS), JSON, min_size=1, max_size=3),
       st.one_of(st.none(), JSON))
def test_hostile_agent_fields(fields, last_message_extra):
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "so", "prefix": last_message_extra,
                 "tool_calls": last_message_extra}]
    for build, serving in ((lambda: ChatCompletionRequest(messages=messages, **fields), CHAT),
                           (lambda: CompletionRequest(prompt="hi", **{
                               k: v for k, v in fields.items() if k in FIELDS[:6]}), COMPLETION)):
        try:
            request = build()
        except ValidationError:
            continue
        try:
            _, _, admission = serving._prepare(request)
            admission.release()
        except APIError as e:
            assert e.status_code == 400
