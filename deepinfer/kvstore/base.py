"""`KVBlockStore`: the shared prefix store interface, and the codec/accounting every backend shares.

Keys are the engine's chained 16-byte block hashes (`core.prefix_hash`); a store is bound to
one salt (weights fingerprint, dtype, block size, layout) at construction and keeps its blocks
apart from other salts'. Values are one block's KV payload as bytes. Every stored block carries
a header and a checksum (`block_codec`); a corrupt or mismatched block is a miss: counted,
logged, deleted, never returned.

Backends implement four raw operations on encoded bytes (`_read`, `_write`, `_exists`,
`_delete`); the base class does encoding, validation and statistics. Backend failures listed
in `transient_errors` (a store that is down or slow) are logged and count as misses / skipped
writes: the engine recomputes instead of failing a request. All methods are thread-safe.
"""
from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from deepinfer.kvstore.block_codec import SALT_LEN, CorruptBlockError, decode_block, encode_block

logger = logging.getLogger("deepinfer.kvstore")


@dataclass(frozen=True)
class KVStoreStats:
    num_hits: int = 0
    num_misses: int = 0  # includes corrupt blocks and backend errors on read
    num_corrupt: int = 0
    num_puts: int = 0  # blocks written
    num_put_skipped: int = 0  # already present
    num_evicted: int = 0
    num_errors: int = 0  # backend failures (unreachable, timeouts, IO errors)
    bytes_read: int = 0  # payload bytes returned by hits
    bytes_written: int = 0  # encoded bytes written

    @property
    def hit_rate(self) -> float:
        total = self.num_hits + self.num_misses
        return self.num_hits / total if total else 0.0


class KVBlockStore(ABC):
    """Content-addressed store of KV blocks for one salt.

    Contract: `put(h, p)` then `get(h)` returns `p` unless the block was evicted, deleted as
    corrupt, or the backend failed; `longest_prefix` is a hint (a block it counts may still be
    evicted or found corrupt by `get`, so callers load blocks in order and stop at the first
    miss).
    """

    backend: str = "base"
    transient_errors: tuple[type[BaseException], ...] = (OSError,)

    def __init__(self, salt: bytes, layout: str = "") -> None:
        if len(salt) != SALT_LEN:
            raise ValueError(f"salt must be {SALT_LEN} bytes (use core.prefix_hash.salt_hash)")
        self.salt = bytes(salt)
        self.layout = layout
        self._lock = threading.Lock()
        self._counts = {name: 0 for name in KVStoreStats.__dataclass_fields__}

    # --- backend ---------------------------------------------------------------------------
    @abstractmethod
    def _read(self, block_hash: bytes) -> bytes | None: ...

    @abstractmethod
    def _write(self, block_hash: bytes, data: bytes) -> None: ...

    @abstractmethod
    def _exists(self, block_hash: bytes) -> bool: ...

    @abstractmethod
    def _delete(self, block_hash: bytes) -> None: ...

    def _unwrap(self, block_hash: bytes, data: bytes) -> bytes:
        """The encoded block inside what the backend returned (a backend that authenticates
        its values checks and strips the tag here, raising CorruptBlockError)."""
        return data

    def close(self) -> None:
        """Release connections/handles. The store must not be used afterwards."""

    # --- interface -------------------------------------------------------------------------
    def get(self, block_hash: bytes) -> bytes | None:
        """The block's payload, or None on a miss (absent, corrupt, or backend failure)."""
        try:
            data = self._read(block_hash)
        except self.transient_errors as exc:
            self._on_error("get", exc)
            self._count(num_misses=1)
            return None
        if data is None:
            self._count(num_misses=1)
            return None
        try:
            payload = bytes(decode_block(self._unwrap(block_hash, data), self.salt, block_hash,
                                         self.layout))
        except CorruptBlockError as exc:
            logger.warning("kvstore(%s): dropping corrupt block %s: %s",
                           self.backend, block_hash.hex(), exc.reason)
            self._count(num_corrupt=1, num_misses=1)
            self._delete_quietly(block_hash)
            return None
        self._count(num_hits=1, bytes_read=len(payload))
        return payload

    def put(self, block_hash: bytes, payload: bytes | memoryview) -> None:
        """Store one block (a no-op when it is already there: blocks are content-addressed)."""
        try:
            if self._exists(block_hash):
                self._count(num_put_skipped=1)
                return
            data = encode_block(self.salt, block_hash, payload, self.layout)
            self._write(block_hash, data)
        except self.transient_errors as exc:
            self._on_error("put", exc)
            return
        self._count(num_puts=1, bytes_written=len(data))

    def contains(self, block_hash: bytes) -> bool:
        try:
            return self._exists(block_hash)
        except self.transient_errors as exc:
            self._on_error("contains", exc)
            return False

    def longest_prefix(self, hashes: Sequence[bytes]) -> int:
        """How many leading hashes of `hashes` are present (a hint; see the class contract)."""
        for i, block_hash in enumerate(hashes):
            if not self.contains(block_hash):
                return i
        return len(hashes)

    def stats(self) -> KVStoreStats:
        with self._lock:
            return KVStoreStats(**self._counts)

    # --- helpers for backends --------------------------------------------------------------
    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counts[name] += delta

    def _on_error(self, op: str, exc: BaseException) -> None:
        self._count(num_errors=1)
        num = self._counts["num_errors"]
        if num == 1 or num % 100 == 0:  # a dead store must not flood the log
            logger.warning("kvstore(%s): %s failed (%d errors so far): %s",
                           self.backend, op, num, exc)

    def _delete_quietly(self, block_hash: bytes) -> None:
        try:
            self._delete(block_hash)
        except self.transient_errors as exc:
            self._on_error("delete", exc)

    def __enter__(self) -> KVBlockStore:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
