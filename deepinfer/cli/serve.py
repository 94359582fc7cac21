"""`deepinfer serve` (placeholder until its issue lands)."""
from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("serve", help="not implemented yet")
    p.set_defaults(func=_run)


def _run(args) -> int:
    from deepinfer.cli.main import CLIError
    raise CLIError("'serve' is not implemented yet")
