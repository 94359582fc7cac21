"""`SharedPrefixTier`: the shared prefix store as the tier below a worker's device prefix cache.

Before a request is queued, `load_prefix` extends the device cache with the prompt's blocks
found in the store: each is written into a free device block, registered under its chained
hash and released (cached-free), so the scheduler's own prefix lookup finds it as if it had
been computed here and the first prefill chunk starts after it (the prompt's device-cached
head is referenced while loading, so the load cannot evict it: `KVCacheManager.
load_prefix_blocks`). The prefill worker reads the payloads on a prefetch thread while the
request queues and calls `load_fetched` (device writes only). `publish` hands full blocks to
the background `KVStoreWriter` as soon as their chunk is computed; `write_through` the rest
of a prefilled prompt's.

Keys are the engine's chained block hashes (same on every process); the store namespaces them
by a salt of the weights' fingerprint, dtype, block size and tensor layout (`store_salt`), and
checks a checksummed header on every read (a corrupt block is a miss: the rest of the prompt
is recomputed).
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch

from deepinfer.core.kv_cache_manager import KVCacheManager
from deepinfer.core.prefix_hash import hash_request_blocks, salt_hash
from deepinfer.kvstore import KVBlockLayout, KVBlockStore, KVStoreWriter
from deepinfer.kvstore.tensor_codec import kv_block_from_bytes, kv_block_to_bytes
from deepinfer.runtime.kv_cache import PagedKVCache
from deepinfer.runtime.model_source import ModelSource

logger = logging.getLogger(__name__)

_KNOWN_STORED_CAPACITY = 65536  # hashes this worker wrote or read recently (skip re-writes)


@dataclass(frozen=True)
class PrefixLoad:
    """What `load_prefix` found: leading blocks already on the device, then from the store."""

    num_device_blocks: int
    num_store_blocks: int


def block_axis_of(cache: PagedKVCache) -> int:
    """The axis of `cache.read_blocks` output that indexes blocks, found by probing (so this
    code follows the runtime's cache layout, whatever it is)."""
    one, two = cache.read_blocks([0]).shape, cache.read_blocks([0, 0]).shape
    [axis] = [i for i, (a, b) in enumerate(zip(one, two)) if a != b]
    return axis


def layout_for_cache(cache: PagedKVCache) -> KVBlockLayout:
    """One stored block: `cache.read_blocks([b])` as is (its block axis has size 1)."""
    shape = tuple(cache.read_blocks([0]).shape)
    axis = block_axis_of(cache)
    axes = tuple("block" if i == axis else f"d{i}" for i in range(len(shape)))
    return KVBlockLayout(str(cache.spec.dtype).removeprefix("torch."), shape, axes)


def store_salt(layout: KVBlockLayout, source: ModelSource, block_size: int) -> bytes:
    """The namespace of this model's blocks in a shared store: a fingerprint of the weight,
    config and tokenizer files (not the model's name: two checkpoints called alike must not
    share KV), KV dtype, block size and tensor layout. Workers that differ in any of them
    never share blocks; the same files give the same salt on every process and machine."""
    return salt_hash("weights:" + source.weights_fingerprint(), layout.dtype, str(block_size),
                     layout.descriptor)


class SharedPrefixTier:
    def __init__(self, store: KVBlockStore, cache: PagedKVCache, kv: KVCacheManager,
                 layout: KVBlockLayout, max_pending_writes: int = 1024) -> None:
        if not kv.enable_prefix_caching:
            raise ValueError("the shared prefix tier needs the device prefix cache")
        self.store = store
        self.cache = cache
        self.kv = kv
        self.layout = layout
        self.block_axis = block_axis_of(cache)
        self.writer = KVStoreWriter(store, max_pending_writes)
        self._known: OrderedDict[bytes, None] = OrderedDict()

    def block_hashes(self, token_ids: list[int], images=(), cache_salt: str | None = None
                     ) -> list[bytes]:
        """`images`: the prompt's image placeholders, hashed into the blocks they overlap
        (as the device prefix cache does), so different images never share stored blocks.
        `cache_salt`: the request's tenant salt, keyed in exactly as the engine's own prefix
        cache keys it, so a salted prompt's stored blocks are only found with that salt."""
        return hash_request_blocks(token_ids, self.kv.block_size, self.kv.hash_salt,
                                   images=images, cache_salt=cache_salt)

    def usable_hashes(self, token_ids: list[int], images=(), cache_salt: str | None = None
                      ) -> list[bytes]:
        """The prompt's full-block hashes a prefix hit may cover (one token is left to
        compute, as in `find_prefix`)."""
        return self.block_hashes(token_ids, images, cache_salt)[
            :(len(token_ids) - 1) // self.kv.block_size]

    def num_device_blocks(self, hashes: list[bytes]) -> int:
        """Leading blocks of `hashes` in the device prefix cache now (a look, no reference)."""
        n = 0
        for block_hash in hashes:
            if not self.kv.pool.is_cached(block_hash):
                break
            n += 1
        return n

    def load_fetched(self, hashes: list[bytes], payloads: dict[bytes, bytes]) -> PrefixLoad:
        """Like `load_prefix`, with the store's payloads already read (by the prefetcher, off
        the engine loop): only device writes happen here."""
        def write(block_id: int, payload: bytes) -> None:
            block = kv_block_from_bytes(payload, self.layout, self.cache.kv.device)
            self.cache.write_blocks([block_id], block)

        load = self.kv.load_prefix_blocks(hashes, payloads.get, write)
        for block_hash in hashes[load.num_device_blocks:][:load.num_loaded_blocks]:
            self._remember(block_hash)
        return PrefixLoad(load.num_device_blocks, load.num_loaded_blocks)

    def publish(self, block_hashes: list[bytes], kv: torch.Tensor) -> int:
        """Queue full blocks just computed (one per hash, in order along `kv`'s block axis)
        unless known stored: every worker can read them from now on. Returns blocks queued."""
        num_queued = 0
        for i, block_hash in enumerate(block_hashes):
            if block_hash in self._known:
                self._known.move_to_end(block_hash)
                continue
            payload = kv_block_to_bytes(kv.narrow(self.block_axis, i, 1), self.layout)
            if self.writer.submit(block_hash, payload):
                self._remember(block_hash)
                num_queued += 1
        return num_queued

    def load_prefix(self, token_ids: list[int], cache_salt: str | None = None) -> PrefixLoad:
        """Bring the prompt's store-cached blocks (after its device-cached ones) into free
        device blocks. At least one token is left to compute, as in `find_prefix`."""
        hashes = self.usable_hashes(token_ids, cache_salt=cache_salt)

        def fetch(block_hash: bytes) -> bytes | None:
            payload = self.store.get(block_hash)
            if payload is not None:
                self._remember(block_hash)
            return payload

        def write(block_id: int, payload: bytes) -> None:
            block = kv_block_from_bytes(payload, self.layout, self.cache.kv.device)
            self.cache.write_blocks([block_id], block)

        load = self.kv.load_prefix_blocks(hashes, fetch, write)
        return PrefixLoad(load.num_device_blocks, load.num_loaded_blocks)

    def write_through(self, token_ids: list[int], kv: torch.Tensor,
                      cache_salt: str | None = None) -> int:
        """Queue the prompt's full blocks not yet known to be stored; returns blocks queued.

        `kv`: `cache.read_blocks` of the prompt's blocks (a copy, not mutated)."""
        return self.publish(self.block_hashes(token_ids, cache_salt=cache_salt), kv)

    def _remember(self, block_hash: bytes) -> None:
        self._known[block_hash] = None
        self._known.move_to_end(block_hash)
        while len(self._known) > _KNOWN_STORED_CAPACITY:
            self._known.popitem(last=False)

    def close(self) -> None:
        self.writer.close(timeout_s=5.0)
        self.store.close()
