"""A chat choice's text -> the assistant message: reasoning split off (`--reasoning-parser`),
then tool calls parsed out of the content (the request's ToolPlan), whole or streamed."""
from __future__ import annotations

from dataclasses import dataclass

from deepinfer.server.protocol import (
    ChatMessage, DeltaFunctionCall, DeltaMessage, DeltaToolCall, FunctionCall, ToolCall,
)
from deepinfer.server.reasoning_parsers import ReasoningStreamer, ThinkReasoningParser
from deepinfer.server.tool_calling import ToolPlan
from deepinfer.server.tool_parsers import (
    NamedCallStreamer, ToolCallStreamer, extract_tool_calls, tool_call_id,
)


@dataclass(frozen=True)
class ChatOutputParser:
    plan: ToolPlan
    reasoning: ThinkReasoningParser | None = None

    @property
    def is_plain(self) -> bool:
        return self.plan.mode == "none" and self.reasoning is None

    def message(self, text: str, finish_reason: str | None) -> tuple[ChatMessage, str | None]:
        """The message of a finished choice, and its finish reason ("tool_calls" when it
        stopped after calling tools)."""
        reasoning, content = (self.reasoning.split(text) if self.reasoning is not None
                              else (None, text))
        calls: list[dict] = []
        if self.plan.mode == "named":
            calls = [{"id": tool_call_id(), "function": {"name": self.plan.named,
                                                         "arguments": content or ""}}]
            content = None
        elif self.plan.mode in ("auto", "required"):
            content, calls = extract_tool_calls(self.plan.parser, content or "")
        if not self.plan.parallel:
            calls = calls[:1]
        tool_calls = [ToolCall(id=c["id"], function=FunctionCall(**c["function"])) for c in calls]
        message = ChatMessage(role="assistant", content=content, reasoning_content=reasoning,
                              tool_calls=tool_calls or None)
        return message, "tool_calls" if tool_calls and finish_reason == "stop" else finish_reason

    def streamer(self) -> ChoiceStreamer:
        return ChoiceStreamer(self)


class ChoiceStreamer:
    """One choice's stream: `update(text so far, finished)` -> the delta to send (None if
    nothing new), keeping reasoning, content and tool-call fragments apart."""

    def __init__(self, parser: ChatOutputParser) -> None:
        plan = parser.plan
        self.plan = plan
        self.reasoning = ReasoningStreamer(parser.reasoning) if parser.reasoning else None
        self.tools = (NamedCallStreamer(plan.named) if plan.mode == "named"
                      else ToolCallStreamer(plan.parser) if plan.parser is not None else None)

    @property
    def called_tools(self) -> bool:
        return self.tools is not None and bool(self.tools.calls)

    def update(self, text: str, finished: bool) -> DeltaMessage | None:
        reasoning, content = "", text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.update(text, finished)
            content_so_far = self.reasoning.sent_content
        else:
            content_so_far = text
        deltas: list[dict] = []
        if self.tools is not None:
            content, deltas = self.tools.update(content_so_far, finished)
            if not self.plan.parallel:
                deltas = [d for d in deltas if d["index"] == 0]
        if not (reasoning or content or deltas):
            return None
        return DeltaMessage(
            content=content or None, reasoning_content=reasoning or None,
            tool_calls=[DeltaToolCall(index=d["index"], id=d.get("id"), type=d.get("type"),
                                      function=DeltaFunctionCall(**d["function"]))
                        for d in deltas] or None)
