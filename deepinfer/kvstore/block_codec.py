"""One stored KV block on the wire/disk: header + payload, checksummed. Bytes in, bytes out.

    offset  size  field
    0       4     magic  b"DIKV"
    4       2     format version (1)
    6       2     layout descriptor length L (bytes, UTF-8)
    8       8     payload length N
    16      16    salt (namespace: weights, dtype, block size, layout)
    32      16    block hash (chained, `core.prefix_hash`)
    48      4     crc32 of bytes [0, 48) + layout + payload
    52      L     layout descriptor (e.g. "layer,kv,head,slot,dim:float16:30x2x3x16x64")
    52+L    N     payload

All integers little-endian. A block whose magic, version, lengths, checksum, salt, hash or
layout does not match what the reader expects raises `CorruptBlockError`; stores turn that
into a miss (counted, logged, the block deleted) so a bad block is never used.
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

MAGIC = b"DIKV"
FORMAT_VERSION = 1
HASH_LEN = 16
SALT_LEN = 16
_FIXED = struct.Struct("<4sHHQ16s16s")  # magic, version, layout_len, payload_len, salt, hash
_CRC = struct.Struct("<I")
HEADER_LEN = _FIXED.size + _CRC.size  # 52


class CorruptBlockError(ValueError):
    """A stored block failed validation; `reason` says which check."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class BlockHeader:
    salt: bytes
    block_hash: bytes
    layout: str
    payload_len: int


def encode_block(salt: bytes, block_hash: bytes, payload: bytes | memoryview, layout: str = "") -> bytes:
    """Header + payload + checksum for one block."""
    if len(salt) != SALT_LEN or len(block_hash) != HASH_LEN:
        raise ValueError(f"salt and block hash must be {SALT_LEN} and {HASH_LEN} bytes, "
                         f"got {len(salt)} and {len(block_hash)}")
    layout_bytes = layout.encode()
    if len(layout_bytes) > 0xFFFF:
        raise ValueError("layout descriptor too long")
    fixed = _FIXED.pack(MAGIC, FORMAT_VERSION, len(layout_bytes), len(payload), salt, block_hash)
    crc = zlib.crc32(payload, zlib.crc32(layout_bytes, zlib.crc32(fixed)))
    return b"".join((fixed, _CRC.pack(crc), layout_bytes, payload))


def read_header(data: bytes | memoryview) -> BlockHeader:
    """Parse and sanity-check the header (not the checksum)."""
    if len(data) < HEADER_LEN:
        raise CorruptBlockError(f"truncated header ({len(data)} bytes)")
    magic, version, layout_len, payload_len, salt, block_hash = _FIXED.unpack_from(data, 0)
    if magic != MAGIC:
        raise CorruptBlockError("bad magic")
    if version != FORMAT_VERSION:
        raise CorruptBlockError(f"unsupported format version {version}")
    if len(data) != HEADER_LEN + layout_len + payload_len:
        raise CorruptBlockError(f"length mismatch: {len(data)} bytes, header says "
                                f"{HEADER_LEN + layout_len + payload_len}")
    try:
        layout = bytes(data[HEADER_LEN:HEADER_LEN + layout_len]).decode()
    except UnicodeDecodeError:
        raise CorruptBlockError("layout descriptor is not UTF-8") from None
    return BlockHeader(salt, block_hash, layout, payload_len)


def decode_block(data: bytes | memoryview, salt: bytes, block_hash: bytes,
                 layout: str | None = None) -> memoryview:
    """The payload of `data` if it is an intact block for (`salt`, `block_hash`[, `layout`]).

    Returns a zero-copy view into `data`. Raises `CorruptBlockError` otherwise.
    """
    view = memoryview(data).cast("B")
    header = read_header(view)
    (stored_crc,) = _CRC.unpack_from(view, _FIXED.size)
    crc = zlib.crc32(view[HEADER_LEN:], zlib.crc32(view[:_FIXED.size]))
    if crc != stored_crc:
        raise CorruptBlockError("checksum mismatch")
    if header.salt != salt:
        raise CorruptBlockError("salt mismatch (another model, dtype, block size or layout)")
    if header.block_hash != block_hash:
        raise CorruptBlockError("block hash mismatch")
    if layout is not None and header.layout != layout:
        raise CorruptBlockError(f"layout mismatch: stored {header.layout!r}, expected {layout!r}")
    return view[len(view) - header.payload_len:]
