"""A deterministic fingerprint of a model's files: the shared KV store's namespace.

Two checkpoints that only share a name (two fine-tunes both called `model.Q4_K_M.gguf`, two
HF folders both called `llama`) must never share KV blocks, and the same files must give the
same fingerprint in every process and on every machine. So the fingerprint hashes contents
only (never paths, mtimes or the host), every byte of every file, each file named relative to
the model's root. (An earlier version sampled windows of big files: two fine-tunes differing
only between windows would have shared KV, silently wrong.)

A checkpoint folder's image-processor configs (`PREPROCESSING_FILES`) are always added when
present: two checkpoints with equal weights but other preprocessing (image size, mean/std,
crop) give other image embeddings, so they must not share stored embeddings or KV blocks.

Reading a 700 GB checkpoint takes minutes, so each file's digest is cached on this machine
(`<cache dir>/deepinfer/fingerprints.json`, written atomically) under its real path, size,
inode, mtime and ctime: any write to the file changes its ctime, which no user can set back,
so a cached digest is never reused for changed contents. Stdlib only.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from collections.abc import Sequence

FORMAT = b"deepinfer-weights-fingerprint-v2"
PREPROCESSING_FILES = ("preprocessor_config.json", "processor_config.json")
CACHE_FILE = "fingerprints.json"
_MAX_CACHE_ENTRIES = 4096


def weights_fingerprint(root: str, files: Sequence[str]) -> str:
    """Hex digest (32 chars) of `files`, each named relative to `root` (a directory, or the
    single model file itself)."""
    h = hashlib.blake2b(FORMAT, digest_size=16)
    base = root if os.path.isdir(root) else os.path.dirname(os.path.abspath(root))
    single = not os.path.isdir(root)
    files = list(files)
    if not single:
        named = {os.path.abspath(p) for p in files}
        files += [p for p in (os.path.join(root, f) for f in PREPROCESSING_FILES)
                  if os.path.isfile(p) and os.path.abspath(p) not in named]
    cache = _load_cache()  # read once and written once for all the checkpoint's files
    before = dict(cache)
    for path in sorted(files, key=lambda p: os.path.relpath(p, base)):
        name = "" if single else os.path.relpath(path, base).replace(os.sep, "/")
        name_bytes = name.encode()
        h.update(struct.pack("<Q", len(name_bytes)) + name_bytes + file_digest(path, cache))
    if cache != before:  # some file was hashed
        _save_cache(cache)
    return h.hexdigest()


def file_digest(path: str, cache: dict | None = None) -> bytes:
    """A digest of the file's size and all its bytes, cached per file version: in `cache`
    (the caller saves it), else in the cache file directly."""
    own = cache is None
    if own:
        cache = _load_cache()
    stat = os.stat(path)
    key = os.path.realpath(path)
    version = [stat.st_size, stat.st_ino, stat.st_mtime_ns, stat.st_ctime_ns]
    entry = cache.get(key)
    if isinstance(entry, dict) and entry.get("version") == version:
        try:
            return bytes.fromhex(entry["digest"])
        except (KeyError, TypeError, ValueError):
            pass  # a damaged entry: hash again
    digest = _hash_file(path, stat.st_size)
    if os.stat(path).st_ctime_ns == stat.st_ctime_ns:  # not written to while we read it
        cache[key] = {"version": version, "digest": digest.hex()}
        if own:
            _save_cache(cache)
    return digest


def _hash_file(path: str, size: int) -> bytes:
    h = hashlib.blake2b(struct.pack("<Q", size), digest_size=16)
    with open(path, "rb") as f:
        remaining = size
        while remaining > 0:
            data = f.read(min(1 << 22, remaining))
            if not data:
                raise OSError(f"{path} shrank while being fingerprinted")
            h.update(data)
            remaining -= len(data)
    return b"F" + h.digest()


def cache_path() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "deepinfer", CACHE_FILE)


def _load_cache() -> dict:
    try:
        with open(cache_path(), encoding="utf-8") as f:
            cache = json.load(f)
        return cache if isinstance(cache, dict) else {}
    except (OSError, ValueError):
        return {}


def _save_cache(cache: dict) -> None:
    """Best effort (a read-only home only costs a re-hash next time); atomic, so concurrent
    workers never read half a file."""
    if len(cache) > _MAX_CACHE_ENTRIES:  # drop the oldest entries (dicts keep insertion order)
        cache = dict(list(cache.items())[-_MAX_CACHE_ENTRIES:])
    path = cache_path()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".fingerprints-")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(cache, f)
        os.replace(tmp, path)
    except OSError:
        pass
