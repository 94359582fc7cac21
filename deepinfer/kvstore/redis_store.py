"""`RedisKVBlockStore`: blocks as Redis strings, shared by every worker that reaches the server.

    key   <key_prefix>:<salt hex>:<hash hex>      value   one encoded block (header + payload)

`longest_prefix` asks for all hashes in one pipelined round trip. Capacity is Redis's own
business: run the server with `maxmemory <bytes>` and `maxmemory-policy allkeys-lru` for LRU
eviction, or give `ttl_s` so blocks expire `ttl_s` after their last read or write. Socket
timeouts are short and failures count as misses, so a dead Redis slows prefill (recompute)
but never hangs or fails a request.

Every value ends with an HMAC-SHA256 tag over its key and block, keyed by the cluster secret
(wire/secret.py): a client that can write to the Redis server but does not hold the secret
cannot plant KV that a worker would use -- such a block is a corrupt miss, deleted.
"""
from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

import redis

from deepinfer.kvstore.base import KVBlockStore
from deepinfer.kvstore.block_codec import CorruptBlockError
from deepinfer.wire.secret import cluster_key

TAG_LEN = 32


class RedisKVBlockStore(KVBlockStore):
    backend = "redis"
    transient_errors = (redis.RedisError, OSError)

    def __init__(self, url: str, salt: bytes, layout: str = "", ttl_s: int | None = None,
                 key_prefix: str = "deepinfer:kv", socket_timeout_s: float = 2.0) -> None:
        super().__init__(salt, layout)
        if ttl_s is not None and ttl_s < 1:
            raise ValueError("ttl_s must be >= 1 second or None")
        self.url = url
        self.ttl_s = ttl_s
        self._key_base = f"{key_prefix}:{self.salt.hex()}:".encode()
        self._mac_key = hmac.new(cluster_key(), b"kv store blocks", hashlib.sha256).digest()
        # from_url does not connect; the first command does.
        self._client = redis.Redis.from_url(url, socket_timeout=socket_timeout_s,
                                            socket_connect_timeout=socket_timeout_s)

    def key(self, block_hash: bytes) -> bytes:
        return self._key_base + block_hash.hex().encode()

    def _read(self, block_hash: bytes) -> bytes | None:
        if self.ttl_s is not None:  # a read renews the lease: TTL works as LRU
            return self._client.getex(self.key(block_hash), ex=self.ttl_s)
        return self._client.get(self.key(block_hash))

    def _write(self, block_hash: bytes, data: bytes) -> None:
        self._client.set(self.key(block_hash), data + self._tag(block_hash, data), ex=self.ttl_s)

    def _tag(self, block_hash: bytes, data) -> bytes:
        mac = hmac.new(self._mac_key, self.key(block_hash), hashlib.sha256)
        mac.update(data)
        return mac.digest()

    def _unwrap(self, block_hash: bytes, data: bytes) -> bytes:
        view = memoryview(data)
        if len(view) < TAG_LEN or not hmac.compare_digest(
                self._tag(block_hash, view[:-TAG_LEN]), view[-TAG_LEN:]):
            raise CorruptBlockError("bad or missing authentication tag (written without "
                                    "this cluster's secret)")
        return view[:-TAG_LEN]

    def _exists(self, block_hash: bytes) -> bool:
        return bool(self._client.exists(self.key(block_hash)))

    def _delete(self, block_hash: bytes) -> None:
        self._client.delete(self.key(block_hash))

    def longest_prefix(self, hashes: Sequence[bytes]) -> int:
        if not hashes:
            return 0
        try:
            pipe = self._client.pipeline(transaction=False)
            for block_hash in hashes:
                pipe.exists(self.key(block_hash))
            present = pipe.execute()
        except self.transient_errors as exc:
            self._on_error("longest_prefix", exc)
            return 0
        for i, found in enumerate(present):
            if not found:
                return i
        return len(hashes)

    def close(self) -> None:
        self._client.close()
