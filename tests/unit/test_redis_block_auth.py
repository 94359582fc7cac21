"""Redis prefix-store values are authenticated with the cluster secret: a writer without it
(or with another deployment's) cannot plant a block a worker would use."""
from __future__ import annotations

import pytest

from deepinfer.core.prefix_hash import salt_hash
from deepinfer.kvstore.block_codec import encode_block
from deepinfer.kvstore.redis_store import RedisKVBlockStore
from deepinfer.wire.secret import SECRET_ENV

SALT = salt_hash("model")
HASH = bytes(range(16))


class FakeRedis:
    def __init__(self):
        self.values: dict[bytes, bytes] = {}

    def get(self, key):
        return self.values.get(key)

    def set(self, key, value, ex=None):
        self.values[key] = bytes(value)

    def exists(self, key):
        return int(key in self.values)

    def delete(self, key):
        self.values.pop(key, None)


def _store(monkeypatch, secret: str, backend: FakeRedis) -> RedisKVBlockStore:
    monkeypatch.setenv(SECRET_ENV, secret)
    store = RedisKVBlockStore("redis://127.0.0.1:1/0", SALT)
    store._client = backend
    return store


def test_round_trip_and_tampering(monkeypatch):
    backend = FakeRedis()
    store = _store(monkeypatch, "secret-one-" + "x" * 16, backend)
    store.put(HASH, b"payload" * 10)
    assert store.get(HASH) == b"payload" * 10
    key = store.key(HASH)
    value = bytearray(backend.values[key])
    value[60] ^= 1  # inside the payload: the CRC would catch it too, the tag first
    backend.values[key] = bytes(value)
    assert store.get(HASH) is None and store.stats().num_corrupt == 1
    assert key not in backend.values  # deleted


@pytest.mark.parametrize("planted", ["unsigned", "other secret"])
def test_a_block_written_without_the_secret_is_never_used(monkeypatch, planted):
    backend = FakeRedis()
    if planted == "unsigned":  # a valid block, checksum and all, but no tag
        reader = _store(monkeypatch, "secret-one-" + "x" * 16, backend)
        backend.values[reader.key(HASH)] = encode_block(SALT, HASH, b"evil" * 10)
    else:
        _store(monkeypatch, "secret-two-" + "y" * 16, backend).put(HASH, b"evil" * 10)
        reader = _store(monkeypatch, "secret-one-" + "x" * 16, backend)
    assert reader.get(HASH) is None
    stats = reader.stats()
    assert stats.num_corrupt == 1 and stats.num_hits == 0
