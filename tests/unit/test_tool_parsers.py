"""Tool-call parsers on strings: whole outputs give the calls (arguments as JSON text) and the
content before them; streaming the same text in pieces of every size gives deltas that
assemble to exactly the non-streamed calls."""
from __future__ import annotations

import json

import pytest

from deepinfer.server.tool_parsers import (
    JsonArrayToolParser, ToolCallStreamer, extract_tool_calls, get_tool_parser,
)

HERMES_TWO = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
              '{"city": "Paris", "days": [1, 2], "unit": "c\\"elsius\\u00e9"}}\n</tool_call>\n'
              '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET", "ok": true, '
              '"n": -12.5e1, "nested": {"a": null}}}\n</tool_call>')


def test_hermes_extracts_calls_and_content():
    content, calls = extract_tool_calls(get_tool_parser("hermes"), HERMES_TWO)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {
        "city": "Paris", "days": [1, 2], "unit": 'c"elsiusé'}
    assert json.loads(calls[1]["function"]["arguments"])["nested"] == {"a": None}
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2


@pytest.mark.parametrize("text", [
    "no calls here", "a <tool_call> {not json} </tool_call>", "<tool_call>[1, 2]</tool_call>",
    '<tool_call>{"arguments": {}}</tool_call>', "",
])
def test_hermes_text_without_valid_calls_is_content(text):
    content, calls = extract_tool_calls(get_tool_parser("hermes"), text)
    assert calls == [] and content == text


def test_unclosed_final_block_still_parses():
    content, calls = extract_tool_calls(get_tool_parser("hermes"),
                                        '<tool_call>{"name": "f", "arguments": {"x": 1}}')
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"x": 1}


def test_unknown_parser_is_an_error():
    with pytest.raises(ValueError, match="unknown tool call parser"):
        get_tool_parser("nope")


def assemble(parser, text: str, step: int) -> tuple[str, list[dict]]:
    streamer = ToolCallStreamer(parser)
    content, calls = "", []
    for end in list(range(step, len(text), step)) + [len(text)]:
        new_content, deltas = streamer.update(text[:end], finished=end == len(text))
        content += new_content
        for d in deltas:
            if "id" in d:
                assert d["index"] == len(calls)
                calls.append({"id": d["id"], "name": d["function"]["name"], "arguments": ""})
            else:
                assert "name" not in d["function"]
            calls[d["index"]]["arguments"] += d["function"]["arguments"]
    return content, calls


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_hermes_stream_assembles_to_the_whole(step):
    parser = get_tool_parser("hermes")
    content, calls = assemble(parser, HERMES_TWO, step)
    want_content, want = extract_tool_calls(parser, HERMES_TWO)
    assert content.strip() == want_content
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (w["function"]["name"], w["function"]["arguments"]) for w in want]


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_plain_text_streams_whole_even_when_it_looks_like_a_marker(step):
    text = "a < b and <tool_ is not a call"
    content, calls = assemble(get_tool_parser("hermes"), text, step)
    assert content == text and calls == []


@pytest.mark.parametrize("step", [1, 5, 1000])
def test_json_array_parser(step):
    text = '[{"name": "f", "parameters": {"q": "x y", "k": [3]}}, {"name": "g", "parameters": {}}]'
    parser = JsonArrayToolParser()
    content, want = extract_tool_calls(parser, text)
    assert content is None and [c["function"]["name"] for c in want] == ["f", "g"]
    got_content, got = assemble(parser, text, step)
    assert got_content == "" and [c["arguments"] for c in got] == [
        c["function"]["arguments"] for c in want]
