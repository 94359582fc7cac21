"""`StoreEmbeddingTier`: image embeddings in the shared store (fs, redis), the second tier of
an `EmbeddingCache`, so a prefill worker can use embeddings an encode worker computed.

Keys: the store takes 16-byte keys, so an image's key is sha256(b"mm:" + image hash)[:16],
under a salt of its own (`embedding_store_salt`: model weights fingerprint), which keeps
embeddings apart from KV blocks and from other models' embeddings in the same store.
Payload: a small header (dtype, shape) then the tensor's raw bytes; blocks carry the store's
checksum, so a corrupt entry is a miss.
"""
from __future__ import annotations

import hashlib
import logging
import struct

import torch

from deepinfer.kvstore.base import KVBlockStore

logger = logging.getLogger(__name__)

SALT_PREFIX = "deepinfer-mm-embeddings-v1"
_HEADER = struct.Struct("<16sB")  # dtype name (padded), number of dims; then int64 dims


def embedding_store_salt(weights_fingerprint: str) -> bytes:
    from deepinfer.core.prefix_hash import salt_hash
    return salt_hash(SALT_PREFIX, weights_fingerprint)


def embedding_key(image_hash: str) -> bytes:
    return hashlib.sha256(b"mm:" + image_hash.encode()).digest()[:16]


def embeds_to_bytes(embeds: torch.Tensor) -> bytes:
    dtype = str(embeds.dtype).removeprefix("torch.").encode()
    header = _HEADER.pack(dtype, embeds.dim()) + struct.pack(f"<{embeds.dim()}q", *embeds.shape)
    flat = embeds.detach().to("cpu").contiguous().reshape(-1)
    return header + flat.view(torch.uint8).numpy().tobytes()


def embeds_from_bytes(payload: bytes) -> torch.Tensor:
    dtype_name, ndim = _HEADER.unpack_from(payload, 0)
    offset = _HEADER.size
    shape = struct.unpack_from(f"<{ndim}q", payload, offset)
    offset += 8 * ndim
    dtype = getattr(torch, dtype_name.rstrip(b"\0").decode())
    raw = torch.frombuffer(bytearray(payload[offset:]), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


class StoreEmbeddingTier:
    """get/put of embeddings in a `KVBlockStore`; failures and corrupt entries are misses."""

    def __init__(self, store: KVBlockStore) -> None:
        self.store = store

    def get(self, image_hash: str) -> torch.Tensor | None:
        payload = self.store.get(embedding_key(image_hash))
        if payload is None:
            return None
        try:
            return embeds_from_bytes(payload)
        except (struct.error, ValueError, TypeError, AttributeError, RuntimeError) as exc:
            logger.warning("unreadable embeddings for image %s in the store: %s", image_hash, exc)
            return None

    def put(self, image_hash: str, embeds: torch.Tensor) -> None:
        self.store.put(embedding_key(image_hash), embeds_to_bytes(embeds))

    def close(self) -> None:
        self.store.close()


def open_embedding_tier(store_url: str | None, source) -> StoreEmbeddingTier | None:
    """The shared-store tier for `source`'s embeddings at `store_url` (None without a store)."""
    if store_url in (None, "none"):
        return None
    from deepinfer.kvstore import open_store
    return StoreEmbeddingTier(open_store(store_url, embedding_store_salt(source.weights_fingerprint())))
