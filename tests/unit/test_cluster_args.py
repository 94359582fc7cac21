"""Disaggregated-serving flags: the library raises ValueError (no CLI types in cluster/), and
`deepinfer serve` turns it into its one-line exit 2 before any worker starts."""
from __future__ import annotations

import argparse

import pytest

from deepinfer.cli.errors import CLIError
from deepinfer.cluster.cluster_args import add_cluster_args
from deepinfer.clients.factory import client_from_args


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_cluster_args(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("argv, message", [
    (("--prefill-workers", "1"), "go together"),
    (("--prefill-workers", "1", "--decode-workers", "1", "--kv-store", "memory"),
     "per process"),
    (("--prefill-workers", "1", "--decode-workers", "0", "--kv-store", "none"),
     "at least one"),
    (("--prefill-workers", "1", "--decode-workers", "1", "--kv-store", "none",
      "--kv-staging-memory", "lots"), "cannot parse memory size"),
    (("--prefill-workers", "1", "--decode-workers", "1", "--kv-store", "none",
      "--loop-stall-timeout", "0"), "loop_stall_timeout_s must be positive"),
])
def test_bad_cluster_flags_raise_value_error_not_the_cli_type(argv, message):
    with pytest.raises(ValueError, match=message) as info:
        client_from_args(parse(*argv), engine_config=None)
    assert not isinstance(info.value, CLIError)


def test_serve_exits_2_with_one_line_on_bad_cluster_flags(capsys):
    import socket

    from deepinfer.cli.main import main
    with socket.socket() as s:  # a port that is free now (serve checks it first)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = main(["serve", "--port", str(port), "--prefill-workers", "1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "go together" in err and len(err.splitlines()) == 1, err


def test_staging_memory_reaches_the_cluster_config():
    import asyncio
    client = client_from_args(
        parse("--prefill-workers", "1", "--decode-workers", "1", "--kv-store", "none",
              "--kv-staging-memory", "512MiB", "--loop-stall-timeout", "12"), engine_config=None)
    try:
        assert client.cluster.max_staged_bytes == 512 * 1024**2
        assert client.cluster.loop_stall_timeout_s == 12.0
    finally:
        asyncio.run(client.shutdown())
