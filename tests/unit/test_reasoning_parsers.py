"""Reasoning parsers on strings: the split of a whole output, and streamed pieces of every
size assembling to that split."""
from __future__ import annotations

import pytest

from deepinfer.server.reasoning_parsers import REASONING_PARSERS, ReasoningStreamer

R1, QWEN3 = REASONING_PARSERS["deepseek_r1"], REASONING_PARSERS["qwen3"]


@pytest.mark.parametrize("parser,text,want", [
    (R1, "<think>\nstep 1 < 2\n</think>\n\nThe answer is 4.", ("\nstep 1 < 2\n", "The answer is 4.")),
    (R1, "step one, opened in the prompt</think>Four.", ("step one, opened in the prompt", "Four.")),
    (R1, "still thinking when it stopped", ("still thinking when it stopped", None)),
    (R1, "<think>a</think>", ("a", None)),
    (QWEN3, "<think>plan</think>\n\nHello!", ("plan", "Hello!")),
    (QWEN3, "Hello, no thinking here.", (None, "Hello, no thinking here.")),
    (QWEN3, "<think>never closed", (None, "<think>never closed")),
    (QWEN3, "", (None, "")),
])
def test_split(parser, text, want):
    assert parser.split(text) == want


@pytest.mark.parametrize("parser,text", [
    (R1, "<think>\nstep 1 < 2 </thin k\n</think>\n\nThe answer is 4."),
    (R1, "opened in the prompt</think>Four. <think> is just text here"),
    (QWEN3, "<think>plan < and </ things</think>\n\nHello!"),
    (QWEN3, "<thinking is not the marker> plain"),
])
@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_stream_assembles_to_the_split(parser, text, step):
    streamer = ReasoningStreamer(parser)
    reasoning = content = ""
    for end in list(range(step, len(text), step)) + [len(text)]:
        r, c = streamer.update(text[:end], finished=end == len(text))
        reasoning += r
        content += c
    want_reasoning, want_content = parser.split(text)
    assert reasoning == (want_reasoning or "") and content == (want_content or "")


def _plan(mode="none"):
    from deepinfer.server.tool_calling import ToolPlan
    from deepinfer.server.tool_parsers import get_tool_parser
    if mode == "none":
        return ToolPlan("none", None)
    return ToolPlan("auto", [], parser=get_tool_parser("hermes"))


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_chat_message_splits_reasoning_then_tool_calls(step):
    from deepinfer.server.chat_output import ChatOutputParser

    text = ('<think>The user wants weather.</think>\n\nChecking.<tool_call>{"name": "w", '
            '"arguments": {"city": "Oslo"}}</tool_call>')
    parser = ChatOutputParser(_plan("auto"), QWEN3)
    message, reason = parser.message(text, "stop")
    assert message.reasoning_content == message.reasoning == "The user wants weather."
    assert message.content == "Checking." and reason == "tool_calls"
    assert message.tool_calls[0].function.arguments == '{"city": "Oslo"}'
    streamer = parser.streamer()
    reasoning = content = arguments = ""
    for end in list(range(step, len(text), step)) + [len(text)]:
        delta = streamer.update(text[:end], finished=end == len(text))
        if delta is None:
            continue
        assert delta.reasoning == delta.reasoning_content  # vLLM's name and DeepSeek's
        reasoning += delta.reasoning_content or ""
        content += delta.content or ""
        arguments += "".join(c.function.arguments or "" for c in delta.tool_calls or [])
    assert (reasoning, content, arguments) == (
        message.reasoning_content, message.content, message.tool_calls[0].function.arguments)
    assert streamer.called_tools


def test_chat_message_without_tools():
    from deepinfer.server.chat_output import ChatOutputParser

    message, reason = ChatOutputParser(_plan(), R1).message("think</think>Answer", "length")
    assert (message.reasoning_content, message.content, message.tool_calls, reason) == (
        "think", "Answer", None, "length")
