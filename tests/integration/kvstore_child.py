"""Child process for the shared-store tests: `python kvstore_child.py MODE URL [SECONDS]`.

Computes the block hashes of a fixed token sequence itself (no hashes are passed in), then
  write   puts every block; prints the hashes
  read    reads every block, checks each payload; prints the hashes and the store's stats
  churn   deletes and rewrites every block in a loop for SECONDS (concurrent writers)
  poll    reads every block in a loop for SECONDS, checking each payload it gets
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


def block_payload(i: int, size: int) -> bytes:
    head = bytes(str(TOKENS[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]), "ascii")
    return (head * (size // len(head) + 1))[:size]


def main() -> None:
    mode, url = sys.argv[1], sys.argv[2]
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
