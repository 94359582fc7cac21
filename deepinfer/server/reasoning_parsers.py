"""Reasoning parsers (`--reasoning-parser`, vLLM's names): split a reasoning model's
`<think>...</think>` from its answer into `reasoning_content` and `content`.

- `deepseek_r1`: the template opens `<think>` in the prompt, so the output may start inside
  the reasoning; everything before `</think>` is reasoning (all of it, if it never closes).
- `qwen3`: reasoning only when the output opens `<think>` and closes it; otherwise (thinking
  switched off) everything is content.

Streaming splits the growing text the same way and sends what each part gained, holding back a
tail that may be the start of a marker, so the deltas assemble to the non-streamed split.
"""
from __future__ import annotations

from dataclasses import dataclass


def _partial_tail(text: str, marker: str) -> int:
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


@dataclass(frozen=True)
class ThinkReasoningParser:
    name: str
    open_in_prompt: bool  # the output may start inside the reasoning (no opening marker)
    start: str = "<think>"
    end: str = "</think>"

    def split(self, text: str, finished: bool = True) -> tuple[str | None, str | None]:
        """(reasoning, content) of the text so far; None for a part that is absent."""
        stripped = text.lstrip()
        if stripped.startswith(self.start):
            body = stripped[len(self.start):]
        elif not finished and stripped and self.start.startswith(stripped):
            return None, None  # may become the opening marker
        elif self.open_in_prompt:
            body = text
        else:
            return None, text
        end = body.find(self.end)
        if end >= 0:
            content = body[end + len(self.end):].lstrip("\n")
            return body[:end], content or None
        if finished:
            return (body, None) if self.open_in_prompt else (None, text)
        return body[:len(body) - _partial_tail(body, self.end)], None


REASONING_PARSERS = {p.name: p for p in (ThinkReasoningParser("deepseek_r1", True),
                                         ThinkReasoningParser("qwen3", False))}


@dataclass
class ReasoningStreamer:
    parser: ThinkReasoningParser
    sent_reasoning: str = ""
    sent_content: str = ""

    def update(self, text: str, finished: bool) -> tuple[str, str]:
        """(new reasoning, new content) since the last call."""
        reasoning, content = self.parser.split(text, finished)
        return self._grow("sent_reasoning", reasoning or ""), self._grow("sent_content", content or "")

    def _grow(self, attr: str, now: str) -> str:
        sent = getattr(self, attr)
        if len(now) <= len(sent) or not now.startswith(sent):
            return ""
        setattr(self, attr, now)
        return now[len(sent):]
