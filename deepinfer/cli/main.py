"""Entry point. Each subcommand lives in its own module with `register(subparsers)`; each
registered parser sets `func(args) -> int`. Bad arguments or input exit 2 with one line."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

from deepinfer.cli.errors import CLIError

SUBCOMMANDS = ("generate", "serve", "bench", "profile", "simulate", "plan", "economics",
               "scale")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse prints usage too)
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="deepinfer", description="DeepInfer LLM inference engine")
    parser.add_argument("--log-level", default="WARNING",
                        help="DEBUG | INFO | WARNING | ERROR (before the command name)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in SUBCOMMANDS:
        importlib.import_module(f"deepinfer.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except CLIError as e:
        print(f"deepinfer {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
