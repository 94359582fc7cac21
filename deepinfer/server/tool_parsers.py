"""Tool-call parsers: a model's text output -> content and OpenAI tool calls, whole or as
stream deltas. Registered by name (`--tool-call-parser`, vLLM's names).

- `hermes` (Hermes, Qwen2.5, Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks, any number, after optional plain content.
- `deepseek_v3` (DeepSeek-V3/R1, and V3.1's shorter form, also named `deepseek_v31`):
  `<｜tool▁calls▁begin｜>` then per call `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` +
  a ```json fenced block of the arguments (V3.1: `NAME<｜tool▁sep｜>ARGS`) +
  `<｜tool▁call▁end｜>`, then `<｜tool▁calls▁end｜>`.
- `llama3_json` (Llama 3.x): an optional `<|python_tag|>`, then `{"name": ..., "parameters":
  {...}}` objects separated by `;`; an output that does not start so is plain content.
- `json_array` (internal): the whole output is `[{"name": ..., "parameters": {...}}, ...]`, what
  the grammar of `tool_choice="required"` makes the model write.

Arguments are reported as JSON text (`json.dumps` of the parsed value). While streaming, the
argument fragments are the part of that text which can no longer change (closing quotes and
brackets the partial parse added are held back), so the fragments of a call concatenate to
exactly the arguments of the non-streamed response.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

import partial_json_parser
from partial_json_parser.core.exceptions import MalformedJSON, PartialJSON

# Held back at the end of a partial call's arguments: what the partial parse closed, and a
# number still being written (its value, and so its JSON text, can change: 1.5 -> 1.5e1).
_UNSETTLED_TAIL = '"}] \n0123456789.eE+-'


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ParsedCall:
    """One call as far as the text shows it: `obj` is the (partially) parsed call object;
    `closed` once no more of it can follow."""

    obj: dict
    closed: bool


@dataclass
class ParsedOutput:
    content: str  # plain text before the calls (only what cannot turn into a call)
    calls: list[ParsedCall]
    valid: bool = True  # False: the text had call markers but a call did not parse


def call_name(obj: dict) -> str | None:
    name = obj.get("name")
    return name if isinstance(name, str) and name else None


def call_arguments(obj: dict):
    return obj.get("arguments", obj.get("parameters", {}))


def dumps(value) -> str:
    return json.dumps(value, ensure_ascii=False)


class ToolParser:
    """`parse(text, finished)`: what the text says so far (complete when `finished`).
    `keeps_special_tokens`: the call markers are tokens that detokenizing with
    skip_special_tokens could drop, so an "auto" request keeps them unless it says."""

    name = ""
    keeps_special_tokens = False

    def parse(self, text: str, finished: bool) -> ParsedOutput:
        raise NotImplementedError


class HermesToolParser(ToolParser):
    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"

    def parse(self, text: str, finished: bool) -> ParsedOutput:
        first = text.find(self.start)
        if first < 0:
            held = 0 if finished else _partial_marker(text, self.start)
            return ParsedOutput(text[:len(text) - held], [])
        calls = []
        for body, closed in self._bodies(text[first:], finished):
            obj = _loads(body, partial=not closed)
            if obj is None or not isinstance(obj, dict):
                if closed:
                    return ParsedOutput(text, [], valid=False)
                obj = {}
            calls.append(ParsedCall(obj, closed))
        return ParsedOutput(text[:first], calls)

    def _bodies(self, text: str, finished: bool):
        pattern = re.compile(re.escape(self.start) + r"(.*?)(" + re.escape(self.end) + r"|$)",
                             re.DOTALL)
        for match in pattern.finditer(text):
            closed = bool(match.group(2)) or finished
            body = match.group(1).strip()
            if body or closed:
                yield body, closed


class JsonArrayToolParser(ToolParser):
    name = "json_array"

    def parse(self, text: str, finished: bool) -> ParsedOutput:
        value = _loads(text, partial=not finished)
        if value is None and text.strip() and finished:
            return ParsedOutput(text, [], valid=False)
        items = value if isinstance(value, list) else []
        calls = [ParsedCall(obj if isinstance(obj, dict) else {}, finished or i < len(items) - 1)
                 for i, obj in enumerate(items)]
        return ParsedOutput("", calls)


class DeepSeekV3ToolParser(ToolParser):
    name = "deepseek_v3"
    keeps_special_tokens = True
    calls_begin, calls_end = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    call_begin, call_end, sep = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"

    def parse(self, text: str, finished: bool) -> ParsedOutput:
        first = min((i for i in (text.find(self.calls_begin), text.find(self.call_begin))
                     if i >= 0), default=-1)
        if first < 0:
            held = 0 if finished else max(_partial_marker(text, self.calls_begin),
                                          _partial_marker(text, self.call_begin))
            return ParsedOutput(text[:len(text) - held], [])
        calls = []
        blocks = text[first:].split(self.call_begin)[1:]
        for n, block in enumerate(blocks):
            closed = self.call_end in block or finished or n < len(blocks) - 1
            obj = self._call(block, closed)
            if obj is None:
                if closed:
                    return ParsedOutput(text, [], valid=False)
                obj = {}
            calls.append(ParsedCall(obj, closed))
        return ParsedOutput(text[:first], calls)

    def _call(self, block: str, closed: bool) -> dict | None:
        """{name, arguments} of one call's text (partial while not `closed`: the name only
        once it is complete, arguments once they began); None if it cannot be a call."""
        block = block.split(self.call_end)[0].split(self.calls_end)[0]
        if not closed:
            block = block[:len(block) - _partial_marker(block, self.call_end)]
        if self.sep not in block:
            return None if closed else {}
        head, rest = block.split(self.sep, 1)
        if head.strip() == "function" and not rest.lstrip().startswith("{"):
            if "\n" not in rest:  # V3: NAME, newline, fenced JSON; the name is still growing
                return None if closed else {}
            name, body = rest.split("\n", 1)
            body = _unfenced(body, closed)
        else:  # V3.1: NAME<｜tool▁sep｜>ARGS
            name, body = head, rest
        name = name.strip()
        if not name:
            return None if closed else {}
        args = _loads(body, partial=not closed)
        if args is None:
            return None if closed else {"name": name}
        return {"name": name, "arguments": args}


def _unfenced(body: str, closed: bool) -> str:
    """The JSON inside a ```json ... ``` block (as much as there is of it)."""
    body = body.lstrip()
    if not closed and "```json\n".startswith(body):
        return ""  # the opening fence is still being written
    match = _FENCE_OPEN.match(body)
    body = body[match.end():] if match else body
    body = body.rstrip()
    return body[:-3] if body.endswith("```") else body if closed else body.rstrip("`")


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    python_tag = "<|python_tag|>"

    def parse(self, text: str, finished: bool) -> ParsedOutput:
        tag = text.find(self.python_tag)
        if text.lstrip().startswith("{"):
            content, start = "", len(text) - len(text.lstrip())
        elif tag >= 0:
            content, start = text[:tag], tag + len(self.python_tag)
        else:
            if finished:
                held = 0
            elif not text.strip():
                held = len(text)  # leading whitespace: a call may still follow
            else:
                held = _partial_marker(text, self.python_tag)
            return ParsedOutput(text[:len(text) - held], [])
        calls = self._objects(text, start, finished)
        if calls is None:
            return ParsedOutput(text, [], valid=False)
        return ParsedOutput(content, calls)

    @staticmethod
    def _objects(text: str, pos: int, finished: bool) -> list[ParsedCall] | None:
        """The `;`-separated call objects from `pos`; None if the text is not such a list."""
        decoder, calls = json.JSONDecoder(), []
        while True:
            pos = _skip_space(text, pos)
            if pos == len(text):
                return calls if calls or not finished else None
            try:
                obj, pos = decoder.raw_decode(text, pos)
            except ValueError:
                partial = None if finished else _loads(text[pos:], partial=True)
                if not isinstance(partial, dict):
                    return None if finished else calls
                calls.append(ParsedCall(partial, False))
                return calls
            if not isinstance(obj, dict):
                return None
            calls.append(ParsedCall(obj, True))
            pos = _skip_space(text, pos)
            if pos < len(text):
                if text[pos] != ";":
                    return None
                pos += 1


_FENCE_OPEN = re.compile(r"```(?:json)?[ \t]*\n?")


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _loads(text: str, partial: bool):
    if not text.strip():
        return None
    try:
        return partial_json_parser.loads(text) if partial else json.loads(text)
    except (ValueError, MalformedJSON, PartialJSON, IndexError, RecursionError):
        return None


def _partial_marker(text: str, marker: str) -> int:
    """How many trailing characters of `text` could be the start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, DeepSeekV3ToolParser, Llama3JsonToolParser)}
TOOL_PARSERS["deepseek_v31"] = DeepSeekV3ToolParser  # the same parser reads both forms


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r} (known: {', '.join(TOOL_PARSERS)})")
    return TOOL_PARSERS[name]()


def extract_tool_calls(parser: ToolParser, text: str) -> tuple[str | None, list[dict]]:
    """(content or None, OpenAI tool_calls) of a finished output; no calls when any block is
    malformed (the text is then all content)."""
    parsed = parser.parse(text, finished=True)
    calls = [c for c in parsed.calls if call_name(c.obj)]
    if not parsed.valid or not calls or len(calls) != len(parsed.calls):
        return text, []
    tool_calls = [{"id": tool_call_id(), "type": "function",
                   "function": {"name": call_name(c.obj), "arguments": dumps(call_arguments(c.obj))}}
                  for c in calls]
    content = parsed.content.strip()
    return content or None, tool_calls


@dataclass
class _StreamedCall:
    id: str
    name: str
    sent_arguments: str = ""


@dataclass
class ToolCallStreamer:
    """Turns the growing output text into OpenAI stream deltas: content fragments and
    `tool_calls` entries ({index, id, type, function: {name, arguments}} first, then
    {index, function: {arguments}} fragments)."""

    parser: ToolParser
    sent_content: int = 0
    calls: list[_StreamedCall] = field(default_factory=list)

    def update(self, text: str, finished: bool) -> tuple[str, list[dict]]:
        parsed = self.parser.parse(text, finished)
        content = parsed.content if parsed.valid else text
        new_content = content[self.sent_content:]
        self.sent_content = max(self.sent_content, len(content))
        deltas = []
        for index, call in enumerate(parsed.calls if parsed.valid else []):
            name = call_name(call.obj)
            args_started = "arguments" in call.obj or "parameters" in call.obj
            if index == len(self.calls):
                if name is None or not (args_started or call.closed):
                    break  # the name may still grow
                self.calls.append(_StreamedCall(tool_call_id(), name))
                deltas.append({"index": index, "id": self.calls[index].id, "type": "function",
                               "function": {"name": name, "arguments": ""}})
            streamed = self.calls[index]
            args = dumps(call_arguments(call.obj))
            if not call.closed:
                args = args.rstrip(_UNSETTLED_TAIL)
            if args.startswith(streamed.sent_arguments) and len(args) > len(streamed.sent_arguments):
                deltas.append({"index": index, "function": {
                    "arguments": args[len(streamed.sent_arguments):]}})
                streamed.sent_arguments = args
        return new_content, deltas


@dataclass
class NamedCallStreamer:
    """A named tool_choice: the whole output is the arguments of function `name`."""

    name: str
    id: str = field(default_factory=tool_call_id)
    sent: int = 0
    calls: list = field(default_factory=list)  # non-empty once the call was announced

    def update(self, text: str, finished: bool) -> tuple[str, list[dict]]:
        deltas = []
        if not self.calls and (text or finished):
            self.calls.append(self.name)
            deltas.append({"index": 0, "id": self.id, "type": "function",
                           "function": {"name": self.name, "arguments": ""}})
        if len(text) > self.sent:
            deltas.append({"index": 0, "function": {"arguments": text[self.sent:]}})
            self.sent = len(text)
        return "", deltas
