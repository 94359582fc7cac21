"""`MemoryKVBlockStore`: an in-process LRU store (the host-memory tier; also handy in tests)."""
from __future__ import annotations

from collections import OrderedDict

from deepinfer.kvstore.base import KVBlockStore


class MemoryKVBlockStore(KVBlockStore):
    """Blocks in a dict, least recently used evicted past `capacity_bytes` (None: unbounded).

    Private to one process: it is a cache tier, not shared storage.
    """

    backend = "memory"

    def __init__(self, salt: bytes, layout: str = "", capacity_bytes: int | None = None) -> None:
        super().__init__(salt, layout)
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ValueError("capacity_bytes must be >= 0 or None")
        self.capacity_bytes = capacity_bytes
        self._blocks: OrderedDict[bytes, bytes] = OrderedDict()
        self._num_bytes = 0

    @property
    def num_bytes(self) -> int:
        return self._num_bytes

    def _read(self, block_hash: bytes) -> bytes | None:
        with self._lock:
            data = self._blocks.get(block_hash)
            if data is not None:
                self._blocks.move_to_end(block_hash)
            return data

    def _write(self, block_hash: bytes, data: bytes) -> None:
        with self._lock:
            old = self._blocks.pop(block_hash, None)
            self._num_bytes += len(data) - (len(old) if old is not None else 0)
            self._blocks[block_hash] = data
            num_evicted = 0
            while self.capacity_bytes is not None and self._num_bytes > self.capacity_bytes:
                _, evicted = self._blocks.popitem(last=False)
                self._num_bytes -= len(evicted)
                num_evicted += 1
            self._counts["num_evicted"] += num_evicted

    def _exists(self, block_hash: bytes) -> bool:
        with self._lock:
            return block_hash in self._blocks

    def _delete(self, block_hash: bytes) -> None:
        with self._lock:
            data = self._blocks.pop(block_hash, None)
            if data is not None:
                self._num_bytes -= len(data)

    def close(self) -> None:
        with self._lock:
            self._blocks.clear()
            self._num_bytes = 0
