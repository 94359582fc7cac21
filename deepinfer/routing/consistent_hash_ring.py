"""`ConsistentHashRing`: stable key → worker mapping that moves few keys when workers change. Pure.

Each worker owns `num_virtual_nodes` points on a 64-bit ring; a key belongs to the first point
at or after its own position. Positions come from blake2b, so every process agrees on them
(no dependence on PYTHONHASHSEED).
"""
from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterable


def ring_position(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


class ConsistentHashRing:
    def __init__(self, worker_ids: Iterable[str], num_virtual_nodes: int = 64) -> None:
        if num_virtual_nodes < 1:
            raise ValueError("num_virtual_nodes must be >= 1")
        self.worker_ids = frozenset(worker_ids)
        if not self.worker_ids:
            raise ValueError("a ring needs at least one worker")
        points = sorted(
            (ring_position(f"{wid}#{i}".encode()), wid)
            for wid in self.worker_ids for i in range(num_virtual_nodes))
        self._positions = [p for p, _ in points]
        self._owners = [w for _, w in points]

    def owner(self, key: bytes) -> str:
        i = bisect.bisect_left(self._positions, ring_position(key))
        return self._owners[i % len(self._owners)]
