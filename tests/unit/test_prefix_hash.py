"""Chained block hashes: deterministic across processes, chained, keyed by extra keys and salt,
full blocks only."""
from __future__ import annotations

import random
import struct
import subprocess
import sys
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.core.prefix_hash import (ROOT_HASH, hash_block_tokens, hash_request_blocks,
                                        salt_hash)

ROOT = Path(__file__).resolve().parents[2]
BS = 4
tokens_st = st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=40)

CHILD = r"""
from deepinfer.core.prefix_hash import hash_block_tokens, hash_request_blocks, salt_hash
tokens = list(range(1000, 1100))
out = [h.hex() for h in hash_request_blocks(tokens, 16)]
out += [h.hex() for h in hash_request_blocks(tokens, 16, parent=salt_hash("m", "bf16", "16"))]
out.append(hash_block_tokens(b"\x01" * 16, [1, 2, 3], extra_keys=("lora-7", 42)).hex())
print(" ".join(out))
"""


def hashes_in_subprocess(seed: str) -> list[str]:
    env = {"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


def test_hashes_are_identical_across_processes_with_different_hash_seeds():
    a = hashes_in_subprocess("0")
    b = hashes_in_subprocess("12345")
    c = hashes_in_subprocess("random")
    assert len(a) == 6 + 6 + 1
    assert a == b == c
    # And equal to this process's values (a third, independent seed).
    tokens = list(range(1000, 1100))
    assert a[:6] == [h.hex() for h in hash_request_blocks(tokens, 16)]


@settings(max_examples=40, deadline=None)
@given(tokens=tokens_st)
def test_only_full_blocks_are_hashed(tokens):
    hashes = hash_request_blocks(tokens, BS)
    assert len(hashes) == len(tokens) // BS
    # The trailing partial block (any fill of 0..BS-1 tokens) never changes or adds hashes.
    full = tokens[:len(hashes) * BS]
    for extra in range(BS):
        assert hash_request_blocks(full + [7] * extra, BS) == hashes


@settings(max_examples=40, deadline=None)
@given(tokens=tokens_st.filter(lambda t: len(t) >= BS), data=st.data())
def test_a_change_in_a_block_changes_that_and_every_later_hash(tokens, data):
    hashes = hash_request_blocks(tokens, BS)
    pos = data.draw(st.integers(0, len(hashes) * BS - 1), label="pos")
    changed = list(tokens)
    changed[pos] = (changed[pos] + 1) % 2**32
    new = hash_request_blocks(changed, BS)
    block = pos // BS
    assert new[:block] == hashes[:block]
    assert all(n != o for n, o in zip(new[block:], hashes[block:]))


def test_chaining_is_the_parent_of_each_block():
    tokens = [random.Random(0).randrange(50_000) for _ in range(4 * BS)]
    hashes = hash_request_blocks(tokens, BS)
    parent = ROOT_HASH
    for i, h in enumerate(hashes):
        assert h == hash_block_tokens(parent, tokens[i * BS:(i + 1) * BS])
        parent = h
    # Same block contents at a different position hash differently.
    repeated = [5] * (3 * BS)
    r = hash_request_blocks(repeated, BS)
    assert len(set(r)) == 3


@settings(max_examples=30, deadline=None)
@given(tokens=tokens_st.filter(lambda t: len(t) >= BS), start=st.integers(0, 10))
def test_resuming_from_a_start_block_continues_the_chain(tokens, start):
    hashes = hash_request_blocks(tokens, BS)
    start = min(start, len(hashes))
    parent = hashes[start - 1] if start else ROOT_HASH
    assert hash_request_blocks(tokens, BS, parent=parent, start_block=start) == hashes[start:]


def test_extra_keys_change_the_hash():
    tokens = [1, 2, 3, 4]
    base = hash_block_tokens(ROOT_HASH, tokens)
    variants = [
        hash_block_tokens(ROOT_HASH, tokens, extra_keys=("lora-a",)),
        hash_block_tokens(ROOT_HASH, tokens, extra_keys=("lora-b",)),
        hash_block_tokens(ROOT_HASH, tokens, extra_keys=(1,)),
        hash_block_tokens(ROOT_HASH, tokens, extra_keys=(2,)),
        hash_block_tokens(ROOT_HASH, tokens, extra_keys=(1, 2)),
        hash_block_tokens(ROOT_HASH, tokens, extra_keys=(2, 1)),
        hash_block_tokens(ROOT_HASH, tokens, extra_keys=("ab", "c")),
        hash_block_tokens(ROOT_HASH, tokens, extra_keys=("a", "bc")),
    ]
    assert len({base, *variants}) == 1 + len(variants)
    # Deterministic for equal keys.
    assert variants[0] == hash_block_tokens(ROOT_HASH, tokens, extra_keys=["lora-a"])


def test_salt_namespaces_every_block():
    tokens = list(range(3 * BS))
    plain = hash_request_blocks(tokens, BS)
    salt_a = salt_hash("model-a", "bfloat16", "16")
    salt_b = salt_hash("model-b", "bfloat16", "16")
    a = hash_request_blocks(tokens, BS, parent=salt_a)
    b = hash_request_blocks(tokens, BS, parent=salt_b)
    assert salt_a != salt_b != ROOT_HASH
    assert not set(plain) & set(a) and not set(a) & set(b) and not set(plain) & set(b)
    assert salt_hash("model-a", "bfloat16", "16") == salt_a


def test_hash_is_16_bytes_and_token_boundaries_matter():
    h = hash_block_tokens(ROOT_HASH, [1, 2])
    assert isinstance(h, bytes) and len(h) == 16
    # Different splits of the same bytes-ish content are different blocks.
    assert hash_block_tokens(ROOT_HASH, [1, 2]) != hash_block_tokens(ROOT_HASH, [2, 1])
    assert hash_block_tokens(ROOT_HASH, [0]) != hash_block_tokens(ROOT_HASH, [0, 0])
    assert hash_block_tokens(ROOT_HASH, [1]) != hash_block_tokens(b"\x01" * 16, [1])


def test_int_and_string_extra_keys_never_collide():
    tokens = [1, 2, 3, 4]
    as_int = hash_block_tokens(ROOT_HASH, tokens, extra_keys=(1,))
    as_str = hash_block_tokens(ROOT_HASH, tokens, extra_keys=(struct.pack("<q", 1).decode(),))
    assert as_int != as_str
