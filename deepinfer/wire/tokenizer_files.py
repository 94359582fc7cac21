"""A tokenizer sent as its files (JSON, vocab, chat template), never pickled.

The engine side saves its tokenizer with `save_pretrained` into a private temp folder and
ships the files' bytes; the front writes them into its own private folder and loads them with
`AutoTokenizer` (no remote code), which rebuilds the same tokenizer class. Only plain file
names from `save_pretrained` are accepted, each size-capped: the struct came over a socket.
"""
from __future__ import annotations

import os
import re
import tempfile

import msgspec

MAX_TOKENIZER_FILE_BYTES = 64 << 20
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


class TokenizerFiles(msgspec.Struct):
    """File name -> contents, as written by the tokenizer's `save_pretrained`."""

    files: dict[str, bytes] = {}


def tokenizer_to_files(tokenizer) -> TokenizerFiles:
    """The files of `tokenizer` (a transformers tokenizer)."""
    with tempfile.TemporaryDirectory(prefix="deepinfer-tok-") as folder:
        tokenizer.save_pretrained(folder)
        files = {}
        for name in sorted(os.listdir(folder)):
            path = os.path.join(folder, name)
            if os.path.isfile(path) and _SAFE_NAME.match(name):
                with open(path, "rb") as f:
                    files[name] = f.read()
    return TokenizerFiles(files)


def tokenizer_from_files(shipped: TokenizerFiles):
    """Rebuild the tokenizer; ValueError for a name or size that `save_pretrained` would not
    have produced."""
    from transformers import AutoTokenizer

    if not shipped.files:
        raise ValueError("no tokenizer files were sent")
    for name, data in shipped.files.items():
        if not _SAFE_NAME.match(name) or name.endswith(".py"):
            raise ValueError(f"unexpected tokenizer file name {name!r}")
        if len(data) > MAX_TOKENIZER_FILE_BYTES:
            raise ValueError(f"tokenizer file {name} is too large ({len(data)} bytes)")
    with tempfile.TemporaryDirectory(prefix="deepinfer-tok-") as folder:
        for name, data in shipped.files.items():
            fd = os.open(os.path.join(folder, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    # from_pretrained reads everything it needs eagerly; the folder can go.
    return tokenizer
