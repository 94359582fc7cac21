"""`FsKVBlockStore`: blocks as files in a directory, shareable between processes and machines.

    <root>/<salt hex>/<first 2 hex of hash>/<hash hex>.kvb     one encoded block per file

Writes go to a temporary file in the same directory and are renamed into place, so a reader
(in any process, or on another machine over a shared mount) sees a whole block or none.
Readers record use by setting the file's mtime on every hit; eviction removes the least
recently used files until the store is under `low_watermark * capacity_bytes`.

The capacity bounds the whole root, every salt's blocks together (the default root is the
user's cache directory, shared by every model and configuration served on the machine; a salt
nobody uses any more ages out). Across processes: each process adds its own writes to the
size it last measured and rescans the root (sizes and mtimes of every block) when that passes
the capacity or after writing `capacity_bytes * rescan_fraction` bytes; one process evicts at a
time (flock). The bound is exact for one writer; N concurrent writers may overshoot it by up to
N * rescan_fraction * capacity_bytes (what the others wrote since their last rescan).
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import re
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from deepinfer.kvstore.base import KVBlockStore, logger

BLOCK_SUFFIX = ".kvb"
TMP_SUFFIX = ".tmp"
STALE_TMP_AGE_S = 3600.0  # temp files of crashed writers older than this are removed on rescan
_SALT_DIR = re.compile(r"[0-9a-f]{32}")  # only these are scanned (and evicted from) in the root


def default_store_root() -> Path:
    """`$XDG_CACHE_HOME/deepinfer/kvstore`, else `~/.cache/deepinfer/kvstore`."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "deepinfer" / "kvstore"


class FsKVBlockStore(KVBlockStore):
    backend = "fs"

    def __init__(self, salt: bytes, root: str | os.PathLike | None = None, layout: str = "",
                 capacity_bytes: int | None = None, low_watermark: float = 0.9,
                 rescan_fraction: float = 0.125, fsync: bool = False,
                 clock: Callable[[], float] = time.time) -> None:
        super().__init__(salt, layout)
        if capacity_bytes is not None and capacity_bytes <= 0:
            raise ValueError("capacity_bytes must be > 0 or None")
        if not 0.0 < low_watermark <= 1.0 or not 0.0 < rescan_fraction <= 1.0:
            raise ValueError("low_watermark and rescan_fraction must be in (0, 1]")
        self.root = Path(root if root is not None else default_store_root())
        self.directory = self.root / self.salt.hex()
        self.capacity_bytes = capacity_bytes
        self.low_watermark = low_watermark
        self.rescan_fraction = rescan_fraction
        self.fsync = fsync
        self.clock = clock
        self._size_lock = threading.Lock()
        self._measured_bytes: int | None = None  # directory size at the last rescan
        self._bytes_since_scan = 0

    def block_path(self, block_hash: bytes) -> Path:
        name = block_hash.hex()
        return self.directory / name[:2] / (name + BLOCK_SUFFIX)

    # --- backend ---------------------------------------------------------------------------
    def _read(self, block_hash: bytes) -> bytes | None:
        path = self.block_path(block_hash)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        now = self.clock()
        with contextlib.suppress(FileNotFoundError):  # evicted meanwhile: the read still counts
            os.utime(path, (now, now))
        return data

    def _write(self, block_hash: bytes, data: bytes) -> None:
        path = self.block_path(block_hash)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}{TMP_SUFFIX}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            now = self.clock()
            os.utime(tmp, (now, now))
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        self._after_write(len(data))

    def _exists(self, block_hash: bytes) -> bool:
        return self.block_path(block_hash).is_file()

    def _delete(self, block_hash: bytes) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.block_path(block_hash).unlink()

    # --- capacity --------------------------------------------------------------------------
    def _after_write(self, num_bytes: int) -> None:
        if self.capacity_bytes is None:
            return
        with self._size_lock:
            self._bytes_since_scan += num_bytes
            estimate = (self._measured_bytes or 0) + self._bytes_since_scan
            due = (self._measured_bytes is None or estimate > self.capacity_bytes
                   or self._bytes_since_scan > self.capacity_bytes * self.rescan_fraction)
        if due:
            self.evict()

    def scan(self) -> list[tuple[float, int, Path]]:
        """(mtime, size, path) of every block file under the root (every salt's); removes
        stale temp files on the way."""
        entries: list[tuple[float, int, Path]] = []
        now = self.clock()
        for salt_dir in _subdirs(self.root):
            if not _SALT_DIR.fullmatch(salt_dir.name):
                continue
            for shard in _subdirs(salt_dir.path):
                with contextlib.suppress(FileNotFoundError):
                    for entry in os.scandir(shard.path):
                        with contextlib.suppress(FileNotFoundError):
                            st = entry.stat()
                            if entry.name.endswith(BLOCK_SUFFIX):
                                entries.append((st.st_mtime, st.st_size, Path(entry.path)))
                            elif (entry.name.endswith(TMP_SUFFIX)
                                  and now - st.st_mtime > STALE_TMP_AGE_S):
                                os.unlink(entry.path)
        return entries

    def evict(self) -> int:
        """Rescan and delete least recently used blocks down to the low watermark.

        Returns the number of blocks removed (0 when another process holds the eviction lock).
        """
        if self.capacity_bytes is None:
            return 0
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".evict.lock", "a+b") as lock_file:
            try:
                fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return 0  # another process is evicting right now
            try:
                return self._evict_locked()
            finally:
                fcntl.flock(lock_file, fcntl.LOCK_UN)

    def _evict_locked(self) -> int:
        entries = self.scan()
        total = sum(size for _, size, _ in entries)
        removed = 0
        if total > self.capacity_bytes:
            target = self.capacity_bytes * self.low_watermark
            for _, size, path in sorted(entries, key=lambda e: e[0]):
                if total <= target:
                    break
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                    removed += 1
                total -= size
            logger.debug("kvstore(fs): evicted %d blocks from %s", removed, self.root)
        with self._size_lock:
            self._measured_bytes = total
            self._bytes_since_scan = 0
        self._count(num_evicted=removed)
        return removed

    def num_bytes(self) -> int:
        """Bytes of block files under the root now, every salt's (a scan)."""
        return sum(size for _, size, _ in self.scan())


def _subdirs(path: str | os.PathLike) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return [e for e in it if e.is_dir(follow_symlinks=False)]
    except (FileNotFoundError, NotADirectoryError):
        return []
