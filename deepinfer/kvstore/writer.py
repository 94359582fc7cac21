"""`KVStoreWriter`: write-through to a `KVBlockStore` on a background thread.

A prefill step hands over finished full blocks with `submit` and never waits for the store:
when the queue is full the block is dropped (counted) rather than blocking the step — a
dropped block only costs a future recompute. Blocks already queued are not queued twice.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

from deepinfer.kvstore.base import KVBlockStore, logger


@dataclass(frozen=True)
class KVStoreWriterStats:
    num_submitted: int
    num_written: int
    num_dropped: int  # queue full or writer closed
    num_failed: int  # put raised an unexpected error
    num_pending: int


class KVStoreWriter:
    def __init__(self, store: KVBlockStore, max_pending_blocks: int = 1024) -> None:
        if max_pending_blocks < 1:
            raise ValueError("max_pending_blocks must be >= 1")
        self.store = store
        self.max_pending_blocks = max_pending_blocks
        self._queue: deque[tuple[bytes, bytes]] = deque()
        self._pending_hashes: set[bytes] = set()
        self._in_progress = 0
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._counts = {"num_submitted": 0, "num_written": 0, "num_dropped": 0, "num_failed": 0}

    def submit(self, block_hash: bytes, payload: bytes) -> bool:
        """Queue one block; never blocks. False when it was dropped (queue full or closed).

        `payload` must not change afterwards (pass an immutable copy of the block's KV).
        """
        with self._cond:
            if block_hash in self._pending_hashes:
                return True
            if self._closed or len(self._queue) >= self.max_pending_blocks:
                self._counts["num_dropped"] += 1
                return False
            self._queue.append((block_hash, payload))
            self._pending_hashes.add(block_hash)
            self._counts["num_submitted"] += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvstore-writer",
                                                daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return True

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every submitted block is written; False if `timeout_s` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._in_progress,
                                       timeout_s)

    def close(self, timeout_s: float | None = 10.0) -> bool:
        """Stop accepting blocks, write what is queued (up to `timeout_s`), stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        drained = self.flush(timeout_s)
        if self._thread is not None:
            self._thread.join(timeout_s)
        return drained

    def stats(self) -> KVStoreWriterStats:
        with self._cond:
            return KVStoreWriterStats(num_pending=len(self._queue) + self._in_progress,
                                      **self._counts)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return  # closed and drained
                block_hash, payload = self._queue.popleft()
                self._in_progress += 1
            ok = True
            try:
                self.store.put(block_hash, payload)
            except Exception:  # the store already absorbs backend errors; this is a bug
                logger.exception("kvstore writer: put of %s failed", block_hash.hex())
                ok = False
            with self._cond:
                self._in_progress -= 1
                self._pending_hashes.discard(block_hash)
                self._counts["num_written" if ok else "num_failed"] += 1
                self._cond.notify_all()
