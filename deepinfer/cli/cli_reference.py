"""docs/cli.md, generated from the argument parser so the reference cannot drift from the code.

    python -m deepinfer.cli.cli_reference > docs/cli.md      (`make docs` does this)

A test regenerates it and fails when the committed file differs.
"""
from __future__ import annotations

import argparse
import os
import sys

from deepinfer.cli.main import build_parser

HEADER = """# Command-line reference

Generated from the argument parser by `make docs` (`python -m deepinfer.cli.cli_reference`);
do not edit by hand. `deepinfer <command> --help` prints the same flags.
"""


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _help_of(parser: argparse.ArgumentParser, name: str) -> str:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                if choice.dest == name:
                    return choice.help or ""
    return ""


def _flag(action: argparse.Action) -> str:
    names = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.dest}`"
    if action.nargs == 0:
        return names
    if action.choices is not None:
        return f"{names} {{{'|'.join(str(c) for c in action.choices)}}}"
    metavar = action.metavar or (action.dest.upper() if action.option_strings else "")
    return f"{names} {metavar}".rstrip()


def _default(action: argparse.Action) -> str:
    if action.nargs == 0 or action.default in (None, argparse.SUPPRESS):
        return ""
    return f"`{action.default}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _help(action: argparse.Action) -> str:
    text = action.help or ""
    if text == argparse.SUPPRESS:
        return ""
    return text % dict(vars(action), prog="deepinfer") if "%(" in text else text


def _group_table(actions: list[argparse.Action]) -> list[str]:
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    for action in actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        rows.append(f"| {_cell(_flag(action))} | {_cell(_default(action))} | "
                    f"{_cell(_help(action))} |")
    return rows if len(rows) > 2 else []


def _command_section(path: str, parser: argparse.ArgumentParser, help_text: str) -> list[str]:
    lines = [f"## `{path}`", ""]
    if help_text:
        lines += [help_text[0].upper() + help_text[1:] + ".", ""]
    for group in parser._action_groups:
        table = _group_table(group._group_actions)
        if not table:
            continue
        title = "options" if group.title == "optional arguments" else group.title
        lines += [f"### {title}", ""] + table + [""]
    for name, sub in _subparsers(parser).items():
        lines += _command_section(f"{path} {name}", sub, _help_of(parser, name))
    return lines


def render() -> str:
    # Flags that default to an environment variable (the API key) must not put this
    # machine's value into the committed reference.
    saved_key = os.environ.pop("OPENAI_API_KEY", None)
    try:
        root = build_parser()
    finally:
        if saved_key is not None:
            os.environ["OPENAI_API_KEY"] = saved_key
    lines = [HEADER, "## `deepinfer`", ""]
    for group in root._action_groups:
        lines += _group_table(group._group_actions)
    lines.append("")
    for name, sub in _subparsers(root).items():
        lines += _command_section(f"deepinfer {name}", sub, _help_of(root, name))
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
