"""Server-wide chat options (vLLM's flag names): the chat template override, automatic tool
choice with a tool-call parser, and the reasoning parser."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from deepinfer.arg_groups import group


@dataclass(frozen=True)
class ChatOptions:
    chat_template: str | None = None  # the template's text (--chat-template FILE)
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None


def add_chat_args(parser: argparse.ArgumentParser) -> None:
    from deepinfer.server.reasoning_parsers import REASONING_PARSERS
    from deepinfer.server.tool_parsers import TOOL_PARSERS

    g = group(parser, "tools")
    g.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template file used instead of the model's own (e.g. one "
                        "that renders tools and tool calls)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='answer tool_choice "auto" (the default when tools are sent) by parsing '
                        "the model's tool calls with --tool-call-parser")
    g.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="how the model writes tool calls (hermes: <tool_call>{json}</tool_call>, "
                        "Hermes / Qwen2.5 / Qwen3)")
    g.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="split the model's <think>...</think> reasoning into reasoning_content")


def chat_options_from_args(args: argparse.Namespace) -> ChatOptions:
    """ValueError for an unreadable template file or auto tool choice without a parser."""
    template = None
    if args.chat_template:
        try:
            with open(args.chat_template, encoding="utf-8") as f:
                template = f.read()
        except OSError as e:
            raise ValueError(f"--chat-template: cannot read {args.chat_template}: "
                             f"{e.strerror}") from None
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    return ChatOptions(template, args.enable_auto_tool_choice, args.tool_call_parser,
                       args.reasoning_parser)
