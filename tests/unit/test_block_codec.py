"""Block codec: round trip, and every kind of damage or mismatch is detected."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.core.prefix_hash import salt_hash
from deepinfer.kvstore.block_codec import (HEADER_LEN, CorruptBlockError, decode_block,
                                           encode_block, read_header)

SALT = salt_hash("model", "float16", "16", "layout")
HASH = bytes(range(16))


@settings(max_examples=50, deadline=None)
@given(st.binary(max_size=4096), st.text(max_size=40), st.binary(min_size=16, max_size=16))
def test_round_trip(payload, layout, block_hash):
    data = encode_block(SALT, block_hash, payload, layout)
    assert len(data) == HEADER_LEN + len(layout.encode()) + len(payload)
    assert bytes(decode_block(data, SALT, block_hash, layout)) == payload
    assert read_header(data).layout == layout


@pytest.mark.parametrize("region", ["magic", "version", "lengths", "salt", "hash", "crc",
                                    "layout", "payload_first", "payload_last"])
def test_any_flipped_byte_is_detected(region):
    payload = bytes(range(256)) * 8
    data = bytearray(encode_block(SALT, HASH, payload, "layer,kv:float16:2x2"))
    offset = {"magic": 0, "version": 4, "lengths": 8, "salt": 20, "hash": 40, "crc": 49,
              "layout": HEADER_LEN + 3, "payload_first": HEADER_LEN + 20,
              "payload_last": len(data) - 1}[region]
    data[offset] ^= 0x40
    with pytest.raises(CorruptBlockError):
        decode_block(bytes(data), SALT, HASH, "layer,kv:float16:2x2")


@pytest.mark.parametrize("cut", [0, 10, HEADER_LEN, -1])
def test_truncated_or_extended_blocks_are_detected(cut):
    data = encode_block(SALT, HASH, b"x" * 100)
    with pytest.raises(CorruptBlockError):
        decode_block(data[:cut], SALT, HASH)
    with pytest.raises(CorruptBlockError, match="length"):
        decode_block(data + b"\0", SALT, HASH)


def test_intact_block_of_another_namespace_hash_or_layout_is_a_mismatch():
    data = encode_block(SALT, HASH, b"payload", "a")
    with pytest.raises(CorruptBlockError, match="salt"):
        decode_block(data, salt_hash("other model"), HASH, "a")
    with pytest.raises(CorruptBlockError, match="hash"):
        decode_block(data, SALT, bytes(16), "a")
    with pytest.raises(CorruptBlockError, match="layout"):
        decode_block(data, SALT, HASH, "b")
    assert bytes(decode_block(data, SALT, HASH)) == b"payload"  # layout unchecked when None


def test_encode_rejects_bad_keys():
    with pytest.raises(ValueError, match="16"):
        encode_block(b"short", HASH, b"")
    with pytest.raises(ValueError, match="16"):
        encode_block(SALT, b"short", b"")
