"""`open_store`: a `KVBlockStore` from a `--kv-store` URL.

    None, "", "fs"          directory under the user cache dir (`fs_store.default_store_root`)
    "fs:///abs/path", "/abs/path", "~/path"
                            directory at that path (blocks go to <path>/<salt hex>/)
    "redis://host:port/db", "rediss://..."
                            Redis; query `?ttl_s=N` sets a TTL renewed on every read
    "memory"                in-process LRU (one process only: tests, host tier)

fs and memory take `?capacity_bytes=N` (or the `capacity_bytes` keyword): the most bytes the
store keeps, least recently used blocks evicted first. An fs store is bounded by default
(`DEFAULT_FS_CAPACITY_BYTES`, every model's blocks under the root together); a memory store
is unbounded by default. Redis capacity is the server's own (`maxmemory` + an LRU policy).
Keyword option `layout`: the descriptor checked on every read.

Any shared store (fs, redis) takes `host_cache_bytes=N`: a bounded host-memory tier of
recently used blocks in front of it, per process (`TieredKVBlockStore`).
"""
from __future__ import annotations

import os
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

from deepinfer.kvstore.base import KVBlockStore

STORE_URL_HELP = ("fs | fs:///path | /path | redis://host:port/db[?ttl_s=N] | memory; "
                  "fs and memory take ?capacity_bytes=N (default: fs under the user cache dir); "
                  "fs and redis take &host_cache_bytes=N (a host-memory tier per worker)")
DEFAULT_FS_CAPACITY_BYTES = 16 * 1024**3


def open_store(url: str | None, salt: bytes, *, layout: str = "",
               capacity_bytes: int | None = None) -> KVBlockStore:
    spec = (url or "fs").strip()
    if spec.startswith(("redis://", "rediss://")):
        from deepinfer.kvstore.redis_store import RedisKVBlockStore
        if capacity_bytes is not None:
            raise ValueError(_REDIS_CAPACITY)
        parts = urlsplit(spec)
        query = _query(parts.query, {"ttl_s", "host_cache_bytes"}, "redis", spec)
        ttl_s = _int_option(query, "ttl_s", spec)
        return _with_host_tier(RedisKVBlockStore(urlunsplit(parts._replace(query="")), salt,
                                                 layout=layout, ttl_s=ttl_s), query, spec)
    base, _, query_text = spec.partition("?")
    query = _query(query_text, {"capacity_bytes", "host_cache_bytes"}, "fs/memory", spec)
    capacity = _capacity(query, capacity_bytes, spec)
    if base == "fs" or base.startswith(("fs://", "/", "~")):
        from deepinfer.kvstore.fs_store import FsKVBlockStore
        path = None if base == "fs" else _fs_path(base)
        return _with_host_tier(FsKVBlockStore(salt, path, layout=layout,
                                              capacity_bytes=capacity or DEFAULT_FS_CAPACITY_BYTES),
                               query, spec)
    if "host_cache_bytes" in query:
        raise ValueError(f"host_cache_bytes is for a shared store (fs, redis), not {spec!r}")
    if base == "memory":
        from deepinfer.kvstore.memory_store import MemoryKVBlockStore
        return MemoryKVBlockStore(salt, layout=layout, capacity_bytes=capacity)
    raise ValueError(f"unknown KV store {spec!r}; expected {STORE_URL_HELP}")


def _with_host_tier(store: KVBlockStore, query: dict[str, list[str]], spec: str):
    host_bytes = _int_option(query, "host_cache_bytes", spec)
    if host_bytes is None:
        return store
    if host_bytes < 1:
        store.close()
        raise ValueError(f"host_cache_bytes must be positive in {spec!r}")
    from deepinfer.kvstore.tiered_store import TieredKVBlockStore
    return TieredKVBlockStore(store, host_bytes)


def with_host_cache(url: str | None, host_cache_bytes: int) -> str:
    """`url` with a host-memory tier of `host_cache_bytes` (how `--kv-host-cache` reaches
    worker processes, which only get the URL)."""
    spec = (url or "fs").strip()
    if host_cache_bytes < 1:
        raise ValueError(f"host cache size must be positive, got {host_cache_bytes}")
    if spec == "memory" or spec.startswith("memory?"):
        raise ValueError("a host-memory tier goes in front of a shared store (fs, redis)")
    if "host_cache_bytes=" in spec:
        raise ValueError(f"{spec!r} already sets host_cache_bytes")
    sep = "&" if "?" in spec else "?"
    return f"{spec}{sep}{urlencode({'host_cache_bytes': host_cache_bytes})}"


def with_capacity(url: str | None, capacity_bytes: int) -> str:
    """`url` with `capacity_bytes` as its query option (how a `--kv-store-capacity` flag
    reaches worker processes, which only get the URL)."""
    spec = (url or "fs").strip()
    if spec.startswith(("redis://", "rediss://")):
        raise ValueError(_REDIS_CAPACITY)
    if capacity_bytes < 1:
        raise ValueError(f"store capacity must be positive, got {capacity_bytes}")
    base, _, query_text = spec.partition("?")
    query = _query(query_text, {"capacity_bytes"}, "fs/memory", spec)
    if "capacity_bytes" in query:
        raise ValueError(f"{spec!r} already sets capacity_bytes")
    return f"{base}?{urlencode({'capacity_bytes': capacity_bytes})}"


_REDIS_CAPACITY = ("a Redis store's capacity is the server's: run it with maxmemory <bytes> and "
                   "maxmemory-policy allkeys-lru")


def _query(text: str, known: set[str], kind: str, spec: str) -> dict[str, list[str]]:
    query = parse_qs(text, keep_blank_values=True)
    unknown = set(query) - known
    if unknown:
        raise ValueError(f"unknown {kind} store option(s) {sorted(unknown)} in {spec!r}")
    return query


def _capacity(query: dict[str, list[str]], keyword: int | None, spec: str) -> int | None:
    in_url = _int_option(query, "capacity_bytes", spec)
    if in_url is not None and keyword is not None and in_url != keyword:
        raise ValueError(f"capacity_bytes given twice ({keyword} and {in_url} in {spec!r})")
    capacity = keyword if keyword is not None else in_url
    if capacity is not None and capacity < 1:
        raise ValueError(f"capacity_bytes must be positive in {spec!r}")
    return capacity


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
