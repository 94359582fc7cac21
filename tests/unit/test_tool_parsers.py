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


DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
DEEPSEEK_V3 = ("I will look it up." + DS_BEGIN
               + DS_CALL + "function" + DS_SEP + 'get_weather\n```json\n{"city": "Paris", '
               '"days": [1, 2], "note": "use ```code``` \\"quoted\\""}\n```' + DS_CALL_END
               + DS_CALL + "function" + DS_SEP + 'get_time\n```json\n{"tz": "CET", "n": -1.5e2}\n```'
               + DS_CALL_END + DS_END)
DEEPSEEK_V31 = (DS_BEGIN + DS_CALL + 'get_weather' + DS_SEP + '{"city": "Paris", "days": 3}'
                + DS_CALL_END + DS_CALL + 'function' + DS_SEP + '{"x": true}' + DS_CALL_END + DS_END)
LLAMA3 = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris; France", '
          '"days": 2}}; {"name": "get_time", "parameters": {"tz": "CET", "nested": {"a": [1.25]}}}')
LLAMA3_BARE = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}'

WANT = {
    DEEPSEEK_V3: ("I will look it up.", [
        ("get_weather", {"city": "Paris", "days": [1, 2], "note": 'use ```code``` "quoted"'}),
        ("get_time", {"tz": "CET", "n": -150.0})]),
    DEEPSEEK_V31: (None, [("get_weather", {"city": "Paris", "days": 3}),
                          ("function", {"x": True})]),
    LLAMA3: (None, [("get_weather", {"city": "Paris; France", "days": 2}),
                    ("get_time", {"tz": "CET", "nested": {"a": [1.25]}})]),
    LLAMA3_BARE: (None, [("get_weather", {"city": "Paris", "unit": "c"})]),
}
CASES = [("deepseek_v3", DEEPSEEK_V3), ("deepseek_v31", DEEPSEEK_V31),
         ("llama3_json", LLAMA3), ("llama3_json", LLAMA3_BARE)]


@pytest.mark.parametrize("name,text", CASES)
def test_native_formats_extract_calls(name, text):
    content, calls = extract_tool_calls(get_tool_parser(name), text)
    want_content, want_calls = WANT[text]
    assert content == want_content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] \
        == want_calls
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)


@pytest.mark.parametrize("name,text", CASES)
def test_native_formats_stream_split_at_every_character(name, text):
    parser = get_tool_parser(name)
    want_content, want = extract_tool_calls(parser, text)
    for step in (1, 2, 5, len(text)):
        content, calls = assemble(parser, text, step)
        assert (content.strip() or None) == want_content
        assert [(c["name"], c["arguments"]) for c in calls] == [
            (w["function"]["name"], w["function"]["arguments"]) for w in want]


def test_native_format_streams_content_before_calls_at_once_each_step():
    # DeepSeek: the content arrives before the first call marker; nothing of the marker leaks.
    streamer = ToolCallStreamer(get_tool_parser("deepseek_v3"))
    head = DEEPSEEK_V3.index(DS_BEGIN)
    sent = "".join(streamer.update(DEEPSEEK_V3[:end], False)[0] for end in range(1, head + 5))
    assert sent == DEEPSEEK_V3[:head]


@pytest.mark.parametrize("name,text", [
    ("deepseek_v3", "plain answer, no calls"),
    ("deepseek_v3", DS_BEGIN + DS_CALL + "function" + DS_SEP + "f\n```json\n{bad}\n```" + DS_CALL_END),
    ("deepseek_v3", DS_BEGIN + DS_CALL + "function" + DS_CALL_END),
    ("llama3_json", "The answer is {not a call}"),
    ("llama3_json", '{"name": "f", "parameters": {"x": 1}} trailing words'),
    ("llama3_json", '{"parameters": {"x": 1}}'),
    ("llama3_json", "[1, 2]"),
    ("llama3_json", ""),
])
def test_native_formats_without_valid_calls_are_content(name, text):
    content, calls = extract_tool_calls(get_tool_parser(name), text)
    assert calls == [] and content == text


@pytest.mark.parametrize("name,text", [
    ("llama3_json", '{"name": "f", "parameters": {"x": 1}} trailing words'),
    ("deepseek_v3", DS_BEGIN + DS_CALL + "function" + DS_SEP + "f\n```json\n{bad}\n```" + DS_CALL_END),
])
def test_a_stream_that_turns_out_not_to_be_calls_sends_all_its_text(name, text):
    for step in (1, 3, len(text)):
        content, calls = assemble(get_tool_parser(name), text, step)
        assert content == text
