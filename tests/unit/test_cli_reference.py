"""docs/cli.md is generated from the parser: it must match what the parser says today."""
from __future__ import annotations

from pathlib import Path

from deepinfer.cli.cli_reference import render

DOC = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def test_cli_reference_matches_the_parser():
    assert DOC.read_text() == render(), "docs/cli.md is stale: run `make docs`"


def test_every_serve_flag_is_in_the_reference_once():
    from deepinfer.cli.main import build_parser
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    text = render()
    section = text[text.index("## `deepinfer serve`"):text.index("## `deepinfer bench`")]
    for action in serve._actions:
        for flag in action.option_strings:
            if flag.startswith("--") and flag != "--help":
                assert section.count(f"`{flag}`") == 1, flag
