"""`deepinfer bench offline | serve`: each kind registers itself from its own module."""
from __future__ import annotations

import importlib.util

_KINDS = ("deepinfer.bench.offline", "deepinfer.bench.serve_cli")


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: offline engine throughput, serving load")
    kinds = p.add_subparsers(dest="bench_kind", required=True, parser_class=type(p))
    for module in _KINDS:
        if importlib.util.find_spec(module) is not None:
            importlib.import_module(module).register(kinds)
