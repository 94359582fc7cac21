"""Child process for the shared-store tests: `python kvstore_child.py MODE URL [SECONDS]`.

Computes the block hashes of a fixed token sequence itself (no hashes are passed in), then
  write   puts every block; prints the hashes
  read    reads every block, checks each payload; prints the hashes and the store's stats
  churn   deletes and rewrites every block in a loop for SECONDS (concurrent writers)
  poll    reads every block in a loop for SECONDS, checking each payload it gets
and, over a longer chain of `LONG_BLOCKS` blocks of `FILL_BYTES` (`python kvstore_child.py
MODE URL ARG`; a capacity goes in the URL, `?capacity_bytes=N`):
  fill    puts blocks FIRST..FIRST+COUNT-1 (ARG = "FIRST:COUNT")
  touch   reads the blocks listed in ARG ("0,3,5"), checking each payload
Output: one JSON line on stdout.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict

from deepinfer.core.prefix_hash import hash_request_blocks, salt_hash
from deepinfer.kvstore import open_store

BLOCK_SIZE = 16
TOKENS = [(i * 7919 + 13) % 49152 for i in range(BLOCK_SIZE * 12)]
SALT = salt_hash("HuggingFaceTB/SmolLM2-135M-Instruct", "float32", str(BLOCK_SIZE), "test")
LONG_BLOCKS = 256
LONG_TOKENS = [(i * 104729 + 7) % 49152 for i in range(BLOCK_SIZE * LONG_BLOCKS)]
FILL_BYTES = 16 * 1024


def long_hashes() -> list[bytes]:
    return hash_request_blocks(LONG_TOKENS, BLOCK_SIZE, parent=SALT)


def long_payload(i: int) -> bytes:
    return i.to_bytes(4, "little") * (FILL_BYTES // 4)


def fill_or_touch(mode: str, url: str, arg: str) -> dict:
    hashes = long_hashes()
    store = open_store(url, SALT)
    bad = 0
    if mode == "fill":
        first, count = map(int, arg.split(":"))
        for i in range(first, first + count):
            store.put(hashes[i], long_payload(i))
    else:
        for i in map(int, arg.split(",")):
            bad += store.get(hashes[i]) != long_payload(i)
    result = {"bad_payloads": bad, "stats": asdict(store.stats()),
              "capacity_bytes": store.capacity_bytes}
    store.close()
    return result


def block_payload(i: int, size: int) -> bytes:
    head = bytes(str(TOKENS[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]), "ascii")
    return (head * (size // len(head) + 1))[:size]


def main() -> None:
    mode, url = sys.argv[1], sys.argv[2]
    if mode in ("fill", "touch"):
        print(json.dumps(fill_or_touch(mode, url, sys.argv[3])))
        return
    seconds = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
    size = 64 * 1024 if mode in ("churn", "poll") else 4096
    hashes = hash_request_blocks(TOKENS, BLOCK_SIZE, parent=SALT)
    store = open_store(url, SALT)
    bad = 0
    if mode == "write":
        for i, h in enumerate(hashes):
            store.put(h, block_payload(i, size))
    elif mode == "read":
        bad = sum(store.get(h) != block_payload(i, size) for i, h in enumerate(hashes))
    elif mode in ("churn", "poll"):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for i, h in enumerate(hashes):
                if mode == "churn":
                    store._delete(h)
                    store.put(h, block_payload(i, size))
                else:
                    got = store.get(h)
                    bad += got is not None and got != block_payload(i, size)
    result = {"hashes": [h.hex() for h in hashes], "longest_prefix": store.longest_prefix(hashes),
              "bad_payloads": bad, "stats": asdict(store.stats()), "str_hash": hash("deepinfer")}
    store.close()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
