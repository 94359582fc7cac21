"""`--kv-store-capacity`: parsed like --kv-cache-memory and folded into the store URL that the
prefill workers open; a store without a byte bound of ours (Redis, none) refuses it."""
from __future__ import annotations

import argparse

import pytest

from deepinfer.clients.factory import client_from_args
from deepinfer.cluster.cluster_args import _store_url_with_capacity, add_cluster_args
from deepinfer.core.prefix_hash import salt_hash
from deepinfer.kvstore import open_store


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_cluster_args(parser)
    return parser.parse_args(list(argv))


def test_capacity_reaches_the_store_the_workers_open(tmp_path):
    args = parse("--kv-store", str(tmp_path), "--kv-store-capacity", "2GiB")
    url = _store_url_with_capacity(args)
    assert url == f"{tmp_path}?capacity_bytes={2 * 1024**3}"
    store = open_store(url, salt_hash("m"))
    assert store.capacity_bytes == 2 * 1024**3
    assert store.directory == tmp_path / salt_hash("m").hex()
    assert _store_url_with_capacity(parse("--kv-store-capacity", "500MB")) == \
        "fs?capacity_bytes=500000000"
    assert _store_url_with_capacity(parse()) == "fs"  # the store's own default applies


@pytest.mark.parametrize("argv, message", [
    (("--kv-store", "redis://127.0.0.1:1/0", "--kv-store-capacity", "1GiB"), "maxmemory"),
    (("--kv-store", "none", "--kv-store-capacity", "1GiB"), "needs a store"),
    (("--kv-store-capacity", "lots"), "cannot parse memory size"),
    (("--kv-store-capacity", "0"), "positive"),
])
def test_bad_capacity_is_a_clear_error(argv, message):
    with pytest.raises(ValueError, match=message):
        _store_url_with_capacity(parse(*argv))
    args = parse("--prefill-workers", "1", "--decode-workers", "1", *argv)
    with pytest.raises(Exception, match=message):  # the CLI's one-line error, before any worker
        client_from_args(args, engine_config=None)
