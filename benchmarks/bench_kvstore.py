"""Prefix-store throughput: put / longest_prefix / get of real-sized KV blocks.

    .venv/bin/python benchmarks/bench_kvstore.py [--store fs|redis://...|memory] [--blocks N]
        [--block-bytes B] [--json out.json]

Default block: SmolLM2-135M float16, 16 tokens = 30 layers x 2 x 3 heads x 16 x 64 x 2 B.
Prints MB/s and per-block latency; writes JSON when asked. Numbers are machine-dependent.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from deepinfer.core.prefix_hash import hash_request_blocks
from deepinfer.kvstore import KVBlockLayout, open_store


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", default=None, help="store URL (default: fs in a temp dir)")
    p.add_argument("--blocks", type=int, default=200)
    p.add_argument("--block-bytes", type=int,
                   default=KVBlockLayout.for_paged_cache(30, 3, 16, 64, "float16").num_bytes)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        url = args.store or f"fs://{tmp}"
        store = open_store(url, os.urandom(16))
        hashes = hash_request_blocks(list(range(16 * args.blocks)), 16)
        payload = os.urandom(args.block_bytes)
        result = {"store": url.split("?")[0] if args.store else "fs (temp dir)",
                  "blocks": args.blocks, "block_bytes": args.block_bytes}
        t0 = time.perf_counter()
        for h in hashes:
            store.put(h, payload)
        t1 = time.perf_counter()
        assert store.longest_prefix(hashes) == len(hashes)
        t2 = time.perf_counter()
        assert all(store.get(h) == payload for h in hashes)
        t3 = time.perf_counter()
        store.close()
    mb = args.blocks * args.block_bytes / 1e6
    result.update(put_mb_s=mb / (t1 - t0), get_mb_s=mb / (t3 - t2),
                  put_ms_per_block=1e3 * (t1 - t0) / args.blocks,
                  get_ms_per_block=1e3 * (t3 - t2) / args.blocks,
                  longest_prefix_ms=1e3 * (t2 - t1))
    for k, v in result.items():
        print(f"{k:>20}: {v:.3f}" if isinstance(v, float) else f"{k:>20}: {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
