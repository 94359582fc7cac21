"""Every `deepinfer ...` command quoted in a code block of the README and the benchmarks page is
one the CLI accepts, and every `benchmarks/*.py` script they name exists."""
from __future__ import annotations

import functools
import re
import shlex
from pathlib import Path

import pytest

from deepinfer.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
PAGES = ("README.md", "docs/benchmarks.md", "docs/usage.md")


def _code_block_lines(text: str) -> list[str]:
    lines, inside, pending = [], False, ""
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            inside, pending = not inside, ""
            continue
        if not inside:
            continue
        pending += line.strip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        lines.append(pending)
        pending = ""
    return lines


def _commands(page: str) -> list[list[str]]:
    text = (ROOT / page).read_text()
    found = _code_block_lines(text)
    # inline `deepinfer ...` spans in prose as well
    found += re.findall(r"`(deepinfer [^`]+)`", text)
    commands = []
    for line in found:
        line = line.split(" # ")[0].strip().rstrip("&").strip()
        argv = shlex.split(line)
        while argv and re.fullmatch(r"[A-Z_]+=\S*", argv[0]):  # leading VAR=value
            argv.pop(0)
        if argv and argv[0].endswith("deepinfer"):
            commands.append(argv)
    return commands


@functools.lru_cache(maxsize=1)
def _parser():
    return build_parser()


CASES = [(page, argv) for page in PAGES for argv in _commands(page)]


def test_the_pages_quote_commands():
    assert len(CASES) >= 10


@pytest.mark.parametrize("page,argv", CASES, ids=[" ".join(a)[:60] for _, a in CASES])
def test_quoted_command_parses(page, argv):
    try:
        _parser().parse_args(argv[1:])
    except SystemExit as e:
        pytest.fail(f"{page}: `{' '.join(argv)}` is refused by the CLI (exit {e.code})")


def test_named_benchmark_scripts_exist():
    for page in PAGES:
        for script in re.findall(r"\bbenchmarks/[\w/]+\.py", (ROOT / page).read_text()):
            assert (ROOT / script).is_file(), f"{page} names {script}, which does not exist"
