"""`open_store`: a `KVBlockStore` from a `--kv-store` URL.

    None, "", "fs"          directory under the user cache dir (`fs_store.default_store_root`)
    "fs:///abs/path", "/abs/path", "~/path"
                            directory at that path (blocks go to <path>/<salt hex>/)
    "redis://host:port/db", "rediss://..."
                            Redis; query `?ttl_s=N` sets a TTL renewed on every read
    "memory"                in-process LRU (one process only: tests, host tier)

Keyword options: `layout` (descriptor checked on every read), `capacity_bytes` (fs, memory).
"""
from __future__ import annotations

import os
from urllib.parse import parse_qs, urlsplit, urlunsplit

from deepinfer.kvstore.base import KVBlockStore

STORE_URL_HELP = ("fs | fs:///path | /path | redis://host:port/db[?ttl_s=N] | memory "
                  "(default: fs under the user cache dir)")


def open_store(url: str | None, salt: bytes, *, layout: str = "",
               capacity_bytes: int | None = None) -> KVBlockStore:
    spec = (url or "fs").strip()
    if spec == "fs" or spec.startswith(("fs://", "/", "~")):
        from deepinfer.kvstore.fs_store import FsKVBlockStore
        path = None if spec == "fs" else _fs_path(spec)
        return FsKVBlockStore(salt, path, layout=layout, capacity_bytes=capacity_bytes)
    if spec == "memory":
        from deepinfer.kvstore.memory_store import MemoryKVBlockStore
        return MemoryKVBlockStore(salt, layout=layout, capacity_bytes=capacity_bytes)
    if spec.startswith(("redis://", "rediss://")):
        from deepinfer.kvstore.redis_store import RedisKVBlockStore
        parts = urlsplit(spec)
        query = parse_qs(parts.query)
        unknown = set(query) - {"ttl_s"}
        if unknown:
            raise ValueError(f"unknown redis store option(s) {sorted(unknown)} in {spec!r}")
        ttl_s = _int_option(query, "ttl_s", spec)
        return RedisKVBlockStore(urlunsplit(parts._replace(query="")), salt, layout=layout,
                                 ttl_s=ttl_s)
    raise ValueError(f"unknown KV store {spec!r}; expected {STORE_URL_HELP}")


def _fs_path(spec: str) -> str:
    path = spec[len("fs://"):] if spec.startswith("fs://") else spec
    path = os.path.expanduser(path)
    if not path or not os.path.isabs(path):
        raise ValueError(f"fs store path must be absolute, got {spec!r} (use fs:///abs/path)")
    return path


def _int_option(query: dict[str, list[str]], name: str, spec: str) -> int | None:
    if name not in query:
        return None
    try:
        return int(query[name][-1])
    except ValueError:
        raise ValueError(f"{name} must be an integer in {spec!r}") from None
