"""`serve --encode-workers`: flag checks (ValueError, the CLI's exit 2) and the encode stage the
disaggregated client gets from them."""
from __future__ import annotations

import argparse
import asyncio

import pytest

from deepinfer.cluster.cluster_args import add_cluster_args
from deepinfer.clients.factory import client_from_args


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_cluster_args(parser)
    return parser.parse_args(list(argv))


PD = ("--prefill-workers", "1", "--decode-workers", "1")


@pytest.mark.parametrize("argv, message", [
    (("--encode-workers", "1"), "needs --prefill-workers and --decode-workers"),
    (("--encode-workers", "0", *PD, "--kv-store", "none"), "at least 1"),
    (("--encode-workers", "1", *PD, "--kv-store", "none"), "needs a shared store"),
    (("--encode-workers", "1", *PD, "--kv-store", "none", "--encode-cache", "lots"),
     "cannot parse memory size"),
])
def test_bad_encode_flags(argv, message):
    with pytest.raises(ValueError, match=message):
        client_from_args(parse(*argv), engine_config=None)


def test_encode_flags_reach_the_encode_stage(tmp_path):
    client = client_from_args(
        parse("--encode-workers", "2", *PD, "--kv-store", f"fs://{tmp_path}", "--encode-cache", "64MiB",
              "--encode-router", "round-robin"), engine_config=None)
    try:
        stage = client.encode_stage
        assert stage.config.num_workers == 2 and stage.config.cache_bytes == 64 * 1024**2
        assert stage.router.name == "round-robin" and stage.config.kv_store_url.startswith("fs://")
    finally:
        asyncio.run(client.shutdown())


def test_no_encode_stage_without_the_flag():
    client = client_from_args(parse(*PD, "--kv-store", "none"), engine_config=None)
    try:
        assert client.encode_stage is None
    finally:
        asyncio.run(client.shutdown())


def test_serve_exits_2_with_one_line_on_bad_encode_flags(capsys):
    from deepinfer.cli.main import main
    from tests.integration.serve_process import free_port

    code = main(["serve", "--port", str(free_port()), "--encode-workers", "2"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "--encode-workers needs --prefill-workers" in err and len(err.splitlines()) == 1, err
