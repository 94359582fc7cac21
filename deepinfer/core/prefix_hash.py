"""Deterministic chained block hashes: one function for every cache tier and every process.

hash(block i) = sha256(parent_hash || extra_keys || token ids of block i), truncated to 16 bytes.
Only full blocks are hashed. A block overlapping an image placeholder carries (image hash, offset
of the block's first image token within the image) per image as extra keys: image tokens all
have the same id, so without them two different images would share blocks. The encoding is fixed-width little-endian so the value does not
depend on PYTHONHASHSEED, the platform or the process.

A request's `cache_salt` (vLLM's name: one tenant's secret) is an extra key of its first block
only; every later hash chains from that one, so two salts share no block in any tier and a
client cannot probe, through cached-token counts, whether another tenant sent a prompt.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Protocol

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


class ImageSpan(Protocol):
    """An image's expanded tokens at prompt positions [offset, offset + length)
    (deepinfer.wire.mm_inputs.ImagePlaceholder)."""

    image_hash: str
    offset: int
    length: int


# Prefixes the salt's key: an image key is a hex digest or an int, never this.
_SALT_TAG = "cache_salt:"


def block_extra_keys(start: int, end: int, images: Sequence[ImageSpan],
                     cache_salt: str | None = None) -> list[int | str]:
    """Extra keys of the block holding token positions [start, end): the request's salt if it
    is the first block, then for every image it overlaps, the image hash and the offset of
    the block's first token within that image."""
    keys: list[int | str] = [_SALT_TAG + cache_salt] if cache_salt and start == 0 else []
    for image in images:
        if image.offset < end and start < image.offset + image.length:
            keys += [image.image_hash, max(start, image.offset) - image.offset]
    return keys


def hash_request_blocks(token_ids: Sequence[int], block_size: int, parent: BlockHash = ROOT_HASH,
                        start_block: int = 0, images: Sequence[ImageSpan] = (),
                        cache_salt: str | None = None) -> list[BlockHash]:
    """Chained hashes of the full blocks of `token_ids` from `start_block` on.

    `parent` must be the hash of block `start_block - 1` (or the root/salt for block 0).
    `images`: the prompt's image placeholders (sorted by offset), hashed in as extra keys.
    `cache_salt`: the request's tenant salt (SamplingParams.cache_salt), keyed into block 0.
    """
    hashes: list[BlockHash] = []
    num_full = len(token_ids) // block_size
    for i in range(start_block, num_full):
        start, end = i * block_size, (i + 1) * block_size
        keys = block_extra_keys(start, end, images, cache_salt)
        parent = hash_block_tokens(parent, token_ids[start:end], keys)
        hashes.append(parent)
    return hashes


def salt_hash(*parts: str) -> BlockHash:
    """A root hash that namespaces blocks by model id, dtype, block size and layout."""
    return hashlib.sha256("\x1f".join(parts).encode()).digest()[:16]
