"""A cheap, deterministic fingerprint of a model's files: the shared KV store's namespace.

Two checkpoints that only share a name (two fine-tunes both called `model.Q4_K_M.gguf`, two
HF folders both called `llama`) must never share KV blocks, and the same files must give the
same fingerprint in every process and on every machine. So the fingerprint hashes contents
only (never paths, mtimes or the host), each file named relative to the model's root:

- files up to `FULL_HASH_MAX_BYTES` (configs, tokenizers, small models): every byte;
- larger files: their size, the whole header (a safetensors JSON header, or the first
  `HEAD_BYTES` of anything else: a GGUF's metadata, tokenizer and tensor-info table) and
  `NUM_WINDOWS` windows of `WINDOW_BYTES` spread evenly over the rest.

A checkpoint folder's image-processor configs (`PREPROCESSING_FILES`) are always added when
present: two checkpoints with equal weights but other preprocessing (image size, mean/std,
crop) give other image embeddings, so they must not share stored embeddings or KV blocks.

A large file is thus read for ~36 MiB, not its size. Names, shapes, dtypes and metadata are
always covered; another fine-tune or quantisation changes every window. An edit confined to
the bytes between two windows of a large file is not seen (the price of not reading it all).
Stdlib only.
"""
from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Sequence

FORMAT = b"deepinfer-weights-fingerprint-v1"
FULL_HASH_MAX_BYTES = 256 * 1024**2
HEAD_BYTES = 32 * 1024**2
NUM_WINDOWS = 1024
WINDOW_BYTES = 4096
_MAX_SAFETENSORS_HEADER = 100 * 1024**2  # the format's own limit
PREPROCESSING_FILES = ("preprocessor_config.json", "processor_config.json")


def weights_fingerprint(root: str, files: Sequence[str]) -> str:
    """Hex digest (32 chars) of `files`, each named relative to `root` (a directory, or the
    single model file itself)."""
    h = hashlib.blake2b(FORMAT, digest_size=16)
    base = root if os.path.isdir(root) else os.path.dirname(os.path.abspath(root))
    single = not os.path.isdir(root)
    files = list(files)
    if not single:
        named = {os.path.abspath(p) for p in files}
        files += [p for p in (os.path.join(root, f) for f in PREPROCESSING_FILES)
                  if os.path.isfile(p) and os.path.abspath(p) not in named]
    for path in sorted(files, key=lambda p: os.path.relpath(p, base)):
        name = "" if single else os.path.relpath(path, base).replace(os.sep, "/")
        name_bytes = name.encode()
        h.update(struct.pack("<Q", len(name_bytes)) + name_bytes + file_digest(path))
    return h.hexdigest()


def file_digest(path: str) -> bytes:
    """A digest of the file's size and all its bytes, or its header and sampled windows."""
    size = os.path.getsize(path)
    h = hashlib.blake2b(struct.pack("<Q", size), digest_size=16)
    with open(path, "rb") as f:
        if size <= FULL_HASH_MAX_BYTES:
            _update_range(h, f, 0, size)
            return b"F" + h.digest()
        head = _header_length(f, size)
        _update_range(h, f, 0, head)
        span = size - head - WINDOW_BYTES
        for i in range(NUM_WINDOWS):
            f.seek(head + span * i // (NUM_WINDOWS - 1))
            h.update(f.read(WINDOW_BYTES))
    return b"S" + h.digest()


def _header_length(f, size: int) -> int:
    """Bytes of the file's header: exact for safetensors, `HEAD_BYTES` for anything else."""
    f.seek(0)
    prefix = f.read(9)
    if len(prefix) == 9 and prefix[8:9] == b"{":  # safetensors: u64 header length + JSON
        (n,) = struct.unpack("<Q", prefix[:8])
        if n <= _MAX_SAFETENSORS_HEADER and 8 + n + WINDOW_BYTES <= size:
            return 8 + n
    return min(HEAD_BYTES, size - WINDOW_BYTES)


def _update_range(h, f, start: int, length: int, chunk: int = 1 << 20) -> None:
    f.seek(start)
    while length > 0:
        data = f.read(min(chunk, length))
        if not data:
            raise OSError(f"{f.name} shrank while being fingerprinted")
        h.update(data)
        length -= len(data)
