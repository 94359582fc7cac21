"""Tool calling for /v1/chat/completions: `tools`, `tool_choice`, `parallel_tool_calls`, and
the assistant `tool_calls` / `tool` messages of a conversation.

How each tool_choice is honoured:
- "none": tools are not shown to the template and the output is plain content;
- "auto": tools go to the template; the server's tool-call parser (`--tool-call-parser`,
  enabled by `--enable-auto-tool-choice`) turns the calls the model writes into `tool_calls`;
- "required": a grammar makes the model write a JSON array of one or more calls
  `[{"name": <one of the tools>, "parameters": <its schema>}]` (one only when
  parallel_tool_calls is false);
- a named function: a grammar makes the whole output that function's arguments.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import jsonschema

from deepinfer.invalid_parameter import InvalidParameter
from deepinfer.server.errors import bad_request
from deepinfer.structured.grammars import build_grammar
from deepinfer.server.tool_parsers import JsonArrayToolParser, ToolParser
from deepinfer.structured.params import StructuredOutputsParams, canonical_schema

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


@dataclass
class ToolPlan:
    mode: str  # "none" | "auto" | "required" | "named"
    tools: list[dict] | None  # what the chat template gets (None: no tools)
    parser: ToolParser | None = None  # how the output becomes tool calls (auto, required)
    named: str | None = None  # the function of a named tool_choice
    structured: StructuredOutputsParams | None = None  # the grammar (required, named)
    parallel: bool = True


def plan_tools(request, auto_parser: ToolParser | None) -> ToolPlan:
    """The request's ToolPlan; 400 for bad tools or a tool_choice this server cannot honour."""
    tools = checked_tools(request.tools)
    choice = request.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    parallel = request.parallel_tool_calls is not False
    if choice == "none":
        return ToolPlan("none", None)
    if not tools:
        raise bad_request("tool_choice requires tools", param="tool_choice")
    if choice == "auto":
        if auto_parser is None:
            raise bad_request('"auto" tool choice requires the server to run with '
                              "--enable-auto-tool-choice and --tool-call-parser",
                              param="tool_choice", code="unsupported_parameter")
        if auto_parser.keeps_special_tokens and "skip_special_tokens" not in request.model_fields_set:
            request.skip_special_tokens = False  # its markers may be special tokens
        return ToolPlan("auto", tools, parser=auto_parser, parallel=parallel)
    if choice == "required":
        calls = {"type": "array", "minItems": 1, "items": {"anyOf": [
            {"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                              "parameters": _parameters(t)},
             "required": ["name", "parameters"]} for t in tools]}}
        if not parallel:
            calls["maxItems"] = 1
        return ToolPlan("required", tools, parser=JsonArrayToolParser(), parallel=parallel,
                        structured=_grammar_of(calls))
    if isinstance(choice, dict) and choice.get("type") == "function" \
            and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        tool = next((t for t in tools if t["function"]["name"] == name), None)
        if tool is None:
            raise bad_request(f"tool_choice names a function that is not in tools: "
                              f"{str(name)[:64]!r}", param="tool_choice")
        return ToolPlan("named", tools, named=name, parallel=parallel,
                        structured=_grammar_of(_parameters(tool)))
    raise bad_request('tool_choice must be "none", "auto", "required" or '
                      '{"type": "function", "function": {"name": ...}}', param="tool_choice")


def _grammar_of(schema: dict) -> StructuredOutputsParams:
    """The constraint for a tools schema; 400 naming `tools` if the grammar cannot be built."""
    try:
        spec = StructuredOutputsParams(json=canonical_schema(schema))
        build_grammar(spec)
    except (InvalidParameter, RecursionError) as e:
        raise bad_request(f"tools: cannot enforce the tool call schema: {e}"[:600],
                          param="tools") from None
    return spec


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def checked_tools(tools: list[dict] | None) -> list[dict]:
    names = set()
    for i, tool in enumerate(tools or []):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" \
                or not isinstance(tool.get("function"), dict):
            raise bad_request(f'{where} must be {{"type": "function", "function": {{...}}}}',
                              param="tools")
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise bad_request(f"{where}.function.name must be 1-64 letters, digits, _ . or -",
                              param="tools")
        if name in names:
            raise bad_request(f"{where}: function {name!r} is defined twice", param="tools")
        names.add(name)
        params = fn.get("parameters")
        if params is not None:
            if not isinstance(params, dict):
                raise bad_request(f"{where}.function.parameters must be a JSON schema object",
                                  param="tools")
            try:
                jsonschema.validators.validator_for(params).check_schema(params)
            except jsonschema.SchemaError as e:
                raise bad_request(f"{where}.function.parameters is not a valid JSON schema: "
                                  f"{e.message[:300]}", param="tools") from None
            except RecursionError:
                raise bad_request(f"{where}.function.parameters is nested too deeply",
                                  param="tools") from None
        if "description" in fn and not isinstance(fn["description"], str):
            raise bad_request(f"{where}.function.description must be a string", param="tools")
    return [{"type": "function", "function": t["function"]} for t in tools or []]


def message_tool_fields(i: int, message: dict[str, Any]) -> dict[str, Any]:
    """The tool fields of messages[i] as chat templates read them: an assistant's
    `tool_calls` (arguments parsed to objects, as Hugging Face templates expect) and a tool
    result's `tool_call_id` / `name`. 400 for malformed ones."""
    out: dict[str, Any] = {}
    role = message.get("role")
    calls = message.get("tool_calls")
    if calls is not None:
        if role != "assistant" or not isinstance(calls, list):
            raise bad_request(f"messages[{i}].tool_calls: only an assistant message has "
                              "tool_calls, as a list", param=f"messages[{i}].tool_calls")
        out["tool_calls"] = [_template_call(i, j, c) for j, c in enumerate(calls)]
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise bad_request(f"messages[{i}]: a tool message needs its tool_call_id",
                              param=f"messages[{i}].tool_call_id")
        out["tool_call_id"] = call_id
        if isinstance(message.get("name"), str):
            out["name"] = message["name"]
    return out


def _template_call(i: int, j: int, call: Any) -> dict[str, Any]:
    where = f"messages[{i}].tool_calls[{j}]"
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request(f"{where} must have a function with a name", param=where)
    arguments = fn.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            raise bad_request(f"{where}.function.arguments is not valid JSON", param=where) from None
    return {"id": call.get("id"), "type": "function",
            "function": {"name": fn["name"], "arguments": arguments}}


def with_arguments_as_text(messages: list[dict[str, Any]], raw_messages: list[dict[str, Any]]
                           ) -> list[dict[str, Any]]:
    """The template `messages` with each call's arguments as the client's JSON text instead
    of an object, for templates that join them into the prompt as a string (DeepSeek's:
    `... + tool['function']['arguments'] + ...`); `raw_messages` are the request's, 1:1."""
    out = []
    for message, raw in zip(messages, raw_messages):
        if "tool_calls" in message:
            calls = []
            for call, raw_call in zip(message["tool_calls"], raw["tool_calls"]):
                text = raw_call["function"].get("arguments", "{}")
                if not isinstance(text, str):
                    text = json.dumps(text, ensure_ascii=False)
                calls.append({**call, "function": {**call["function"], "arguments": text}})
            message = {**message, "tool_calls": calls}
        out.append(message)
    return out


def template_renders(tokenizer, chat_template: str | None, word: str) -> bool:
    """Whether the chat template in use mentions `word` (e.g. "tools", "tool_calls"): one
    that does not would drop them from the prompt without a word."""
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: any of them
        template = " ".join(str(t) for t in template.values())
    return isinstance(template, str) and word in template
