"""The shared store's namespace is a fingerprint of the weights, not the model's name.

Two tiny checkpoints with the same served name (same HF folder basename, same GGUF file name)
but different weights get different salts, so a KV block one writes is a miss for the other;
identical files get the same salt in any folder and in another process."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from deepinfer.cluster.prefix_store_tier import store_salt
from deepinfer.kvstore import KVBlockLayout, open_store
from deepinfer.runtime import weights_fingerprint as wf
from deepinfer.runtime.model_source import resolve_model

LAYOUT = KVBlockLayout.for_paged_cache(num_layers=2, num_kv_heads=2, block_size=16, head_dim=16,
                                       dtype="float32")
BLOCK_HASH = b"\x07" * 16


def write_hf(directory, seed: int) -> str:
    from tests.integration.tiny_models import tiny_hf_model
    tiny_hf_model("llama", seed=seed).save_pretrained(directory)
    return str(directory)


def write_gguf_file(path, seed: int) -> str:
    from gguf import GGMLQuantizationType as QT

    from tests.integration.tiny_gguf import write_gguf
    from tests.integration.tiny_models import tiny_hf_model
    model = tiny_hf_model("llama", seed=seed)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_gguf(path, "llama", model.config,
               {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}, QT.F32)
    return str(path)


@pytest.fixture(params=["hf", "gguf"])
def same_named_pair(request, tmp_path):
    """(a, b, a's copy under another name): a and b share a served name, not weights."""
    if request.param == "hf":
        a, b = write_hf(tmp_path / "a" / "tiny", 1), write_hf(tmp_path / "b" / "tiny", 2)
        copy = shutil.copytree(a, tmp_path / "c" / "renamed")
    else:
        a = write_gguf_file(str(tmp_path / "a" / "tiny.Q8_0.gguf"), 1)
        b = write_gguf_file(str(tmp_path / "b" / "tiny.Q8_0.gguf"), 2)
        os.makedirs(tmp_path / "c")
        copy = shutil.copy(a, tmp_path / "c" / "renamed.gguf")
    return a, b, str(copy)


def salt_of(path: str) -> bytes:
    return store_salt(LAYOUT, resolve_model(path), LAYOUT.block_size)


def test_same_named_checkpoints_never_share_store_blocks(same_named_pair, tmp_path):
    a, b, copy = same_named_pair
    assert resolve_model(a).name == resolve_model(b).name  # what the old salt was made of
    salt_a, salt_b = salt_of(a), salt_of(b)
    assert salt_a != salt_b
    root = tmp_path / "store"
    writer = open_store(str(root), salt_a, layout=LAYOUT.descriptor)
    writer.put(BLOCK_HASH, b"KV of model a")
    reader = open_store(str(root), salt_b, layout=LAYOUT.descriptor)
    assert reader.get(BLOCK_HASH) is None and reader.longest_prefix([BLOCK_HASH]) == 0
    # The same files under another name and folder do share: the salt is their content.
    assert salt_of(copy) == salt_a
    assert open_store(str(root), salt_of(copy), layout=LAYOUT.descriptor).get(BLOCK_HASH) \
        == b"KV of model a"


def test_salt_covers_the_tokenizer_and_config_files(tmp_path):
    a = write_hf(tmp_path / "a" / "tiny", 1)
    b = shutil.copytree(a, tmp_path / "b" / "tiny")
    (b / "tokenizer_config.json").write_text('{"model_max_length": 128}')
    assert salt_of(str(b)) != salt_of(a)


@pytest.mark.slow
def test_same_checkpoint_gets_the_same_salt_in_another_process(tmp_path):
    path = write_gguf_file(str(tmp_path / "m" / "tiny.F32.gguf"), 3)
    code = ("import sys; from tests.integration.test_weights_fingerprint import salt_of; "
            "print(salt_of(sys.argv[1]).hex())")
    out = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True,
                         timeout=120, check=True, cwd=os.getcwd(),
                         env={**os.environ, "PYTHONHASHSEED": "123"})
    assert out.stdout.strip() == salt_of(path).hex()


@pytest.fixture
def cache_home(monkeypatch, tmp_path):
    """The digest cache in this test's own folder."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_change_anywhere_in_a_large_file_changes_its_digest(cache_home, tmp_path):
    path = tmp_path / "w.bin"
    data = bytes(range(256)) * 4096  # 1 MiB
    path.write_bytes(data)
    base = wf.file_digest(str(path))
    for offset in (0, 12345, len(data) // 2 + 7, len(data) - 1):  # every byte counts
        changed = bytearray(data)
        changed[offset] ^= 0xFF
        path.write_bytes(bytes(changed))
        assert wf.file_digest(str(path)) != base, offset
    path.write_bytes(data + b"\0")
    assert wf.file_digest(str(path)) != base
    path.write_bytes(data)
    assert wf.file_digest(str(path)) == base


def test_digests_are_cached_per_file_version(cache_home, tmp_path, monkeypatch):
    path = tmp_path / "w.bin"
    path.write_bytes(b"a" * 100_000)
    first = wf.file_digest(str(path))
    assert (cache_home / "deepinfer" / wf.CACHE_FILE).is_file()
    reads = []
    real_hash = wf._hash_file
    monkeypatch.setattr(wf, "_hash_file", lambda *a: reads.append(a) or real_hash(*a))
    assert wf.file_digest(str(path)) == first and reads == []  # from the cache
    # Same size, mtime put back: the ctime still moves, so the file is read again.
    stat = os.stat(path)
    path.write_bytes(b"b" * 100_000)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert wf.file_digest(str(path)) != first and len(reads) == 1
    # A damaged cache file is ignored, never trusted.
    (cache_home / "deepinfer" / wf.CACHE_FILE).write_text("{not json")
    assert wf.file_digest(str(path)) == real_hash(str(path), 100_000)
