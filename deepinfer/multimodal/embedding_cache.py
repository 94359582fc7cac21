"""`EmbeddingCache`: image embeddings keyed by image content hash, LRU by bytes.

The local tier holds tensors in this process. An optional second tier (`EmbeddingStoreTier`,
the shared store under keys b"mm:" + hash) sits behind the same `get`/`put`: a local miss asks
the store and keeps what it finds, and every `put` is written through, so any worker can fetch
an image another worker encoded. Hits are counted per tier ("local", "store").
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # tensors pass through; this module needs no torch of its own
    import torch

LOCAL_TIER = "local"
STORE_TIER = "store"


class EmbeddingStoreTier(Protocol):
    """A shared tier: tensors in, tensors out; failures are misses, never exceptions."""

    def get(self, image_hash: str) -> torch.Tensor | None: ...

    def put(self, image_hash: str, embeds: torch.Tensor) -> None: ...


def tensor_nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class EmbeddingCache:
    """LRU of image embeddings ([tokens, hidden] per image), bounded by `capacity_bytes`.

    An entry larger than the whole capacity is not kept locally (it still goes to the store).
    Thread-safe: the engine loop and a worker's receive thread may both use it.
    """

    def __init__(self, capacity_bytes: int, store: EmbeddingStoreTier | None = None) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.store = store
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()
        self.used_bytes = 0
        self.hits = 0
        self.misses = 0
        self.hits_by_tier: dict[str, int] = {LOCAL_TIER: 0, STORE_TIER: 0}
        self.num_evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, image_hash: str) -> bool:
        """Local presence only; does not touch LRU order or counters."""
        return image_hash in self._entries

    def get(self, image_hash: str) -> torch.Tensor | None:
        with self._lock:
            embeds = self._entries.get(image_hash)
            if embeds is not None:
                self._entries.move_to_end(image_hash)
                self.hits += 1
                self.hits_by_tier[LOCAL_TIER] += 1
                return embeds
        embeds = self.store.get(image_hash) if self.store is not None else None
        with self._lock:
            if embeds is None:
                self.misses += 1
                return None
            self.hits += 1
            self.hits_by_tier[STORE_TIER] += 1
            self._insert(image_hash, embeds)
        return embeds

    def put(self, image_hash: str, embeds: torch.Tensor) -> None:
        with self._lock:
            self._insert(image_hash, embeds)
        if self.store is not None:
            self.store.put(image_hash, embeds)

    def put_local(self, image_hash: str, embeds: torch.Tensor) -> None:
        """Keep `embeds` in this process only (they came from the store or a peer)."""
        with self._lock:
            self._insert(image_hash, embeds)

    def _insert(self, image_hash: str, embeds: torch.Tensor) -> None:
        old = self._entries.pop(image_hash, None)
        if old is not None:
            self.used_bytes -= tensor_nbytes(old)
        size = tensor_nbytes(embeds)
        if size > self.capacity_bytes:
            return
        while self._entries and self.used_bytes + size > self.capacity_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.used_bytes -= tensor_nbytes(evicted)
            self.num_evicted += 1
        self._entries[image_hash] = embeds
        self.used_bytes += size

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


def embedding_stats(engine) -> dict:
    """An engine's image counters for its stats snapshot ({} without a vision tower)."""
    cache = getattr(engine, "embedding_cache", None)
    if cache is None:
        return {}
    images = getattr(engine, "mm_images", None)
    return {"embedding_cache_hits": cache.hits, "embedding_cache_misses": cache.misses,
            "num_images_encoded": getattr(images, "num_images_encoded", 0)}
