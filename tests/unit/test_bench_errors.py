"""Benchmark library code raises its own `BenchError` (a ValueError), not the CLI's error type;
the `deepinfer bench` layer turns it into a one-line exit 2."""
from __future__ import annotations

import argparse
import socket

import pytest

from deepinfer.bench import serve_cli
from deepinfer.bench.errors import BenchError
from deepinfer.cli.errors import CLIError
from deepinfer.cli.main import main


def serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve_cli.register(parser.add_subparsers())
    return parser.parse_args(["serve", "--no-progress", *argv])


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when this returns: nothing listens there


@pytest.mark.parametrize("argv", [
    ["--token-id-range", "x"],
    ["--workload", "trace:/nonexistent/trace.jsonl"],
    ["--workload", "nonsense"],
], ids=["token range", "missing trace", "unknown workload"])
def test_bench_serve_library_raises_bench_error(argv):
    with pytest.raises(BenchError) as info:
        serve_cli.run(serve_args(*argv))
    assert isinstance(info.value, ValueError) and not isinstance(info.value, CLIError)


def test_unreachable_server_is_a_bench_error():
    url = f"http://127.0.0.1:{closed_port()}"
    with pytest.raises(BenchError, match="127.0.0.1"):
        serve_cli.run(serve_args("--base-url", url, "--num-prompts", "2"))


@pytest.mark.parametrize("argv", [
    ["serve", "--no-progress", "--token-id-range", "x"],
    ["offline", "--num-prompts", "0"],
], ids=["serve", "offline"])
def test_cli_exits_2_with_one_line(argv, capsys):
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("deepinfer bench: error: ")
