"""Shared prefix store: KV blocks keyed by chained block hashes, behind one interface.

Backends: `fs` (a directory, shareable), `redis`, `memory` (in-process). Open one with
`open_store(url, salt)`; write through with `KVStoreWriter`. Torch-free except
`tensor_codec`; `redis` is imported only by the Redis backend.
"""
from deepinfer.kvstore.base import KVBlockStore, KVStoreStats
from deepinfer.kvstore.block_codec import CorruptBlockError, decode_block, encode_block
from deepinfer.kvstore.block_layout import KVBlockLayout
from deepinfer.kvstore.factory import STORE_URL_HELP, open_store
from deepinfer.kvstore.writer import KVStoreWriter, KVStoreWriterStats

__all__ = ["CorruptBlockError", "KVBlockLayout", "KVBlockStore", "KVStoreStats", "KVStoreWriter",
           "KVStoreWriterStats", "STORE_URL_HELP", "decode_block", "encode_block", "open_store"]
