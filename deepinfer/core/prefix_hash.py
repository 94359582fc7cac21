"""Deterministic chained block hashes: one function for every cache tier and every process.

hash(block i) = sha256(parent_hash || extra_keys || token ids of block i), truncated to 16 bytes.
Only full blocks are hashed. The encoding is fixed-width little-endian so the value does not
depend on PYTHONHASHSEED, the platform or the process.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes  # 16 bytes

# The parent of the first block; a salt (model id, dtype, layout) can replace it per store.
ROOT_HASH: BlockHash = b"\x00" * 16


def hash_block_tokens(parent: BlockHash, token_ids: Sequence[int],
                      extra_keys: Sequence[int | str] = ()) -> BlockHash:
    h = hashlib.sha256()
    h.update(parent)
    for key in extra_keys:
        # A type tag keeps the int 1 and the string of its packed bytes apart.
        tag, data = (b"s", key.encode()) if isinstance(key, str) else (b"i", struct.pack("<q", key))
        h.update(tag + struct.pack("<I", len(data)))
        h.update(data)
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return h.digest()[:16]


def hash_request_blocks(token_ids: Sequence[int], block_size: int, parent: BlockHash = ROOT_HASH,
                        start_block: int = 0) -> list[BlockHash]:
    """Chained hashes of the full blocks of `token_ids` from `start_block` on.

    `parent` must be the hash of block `start_block - 1` (or the root/salt for block 0).
    """
    hashes: list[BlockHash] = []
    num_full = len(token_ids) // block_size
    for i in range(start_block, num_full):
        parent = hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes


def salt_hash(*parts: str) -> BlockHash:
    """A root hash that namespaces blocks by model id, dtype, block size and layout."""
    return hashlib.sha256("\x1f".join(parts).encode()).digest()[:16]
