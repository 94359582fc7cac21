"""`deepinfer bench offline | serve`: each kind registers itself from its own module; the
benchmarks' own user errors (`BenchError`) become the CLI's one-line exit here."""
from __future__ import annotations

import functools
import importlib.util

from deepinfer.cli.errors import CLIError

_KINDS = ("deepinfer.bench.offline", "deepinfer.bench.serve_cli", "deepinfer.bench.perplexity")


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: offline engine throughput (--profile: "
                                     "op traces), serving load, perplexity")
    kinds = p.add_subparsers(dest="bench_kind", required=True, parser_class=type(p))
    for module in _KINDS:
        if importlib.util.find_spec(module) is not None:
            importlib.import_module(module).register(kinds)
    for parser in kinds.choices.values():
        parser.set_defaults(func=_bench_errors_to_cli(parser.get_default("func")))


def _bench_errors_to_cli(func):
    @functools.wraps(func)
    def run(args) -> int:
        from deepinfer.bench.errors import BenchError
        try:
            return func(args)
        except BenchError as e:
            raise CLIError(str(e)) from None
    return run
