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
def small_limits(monkeypatch):
    """Make 64 KiB files 'large' so the sampled path is exercised on small files."""
    monkeypatch.setattr(wf, "FULL_HASH_MAX_BYTES", 16 * 1024)
    monkeypatch.setattr(wf, "HEAD_BYTES", 4096)
    monkeypatch.setattr(wf, "NUM_WINDOWS", 8)
    monkeypatch.setattr(wf, "WINDOW_BYTES", 256)


def sampled_digest(tmp_path, data: bytes) -> bytes:
    path = tmp_path / "w.bin"
    path.write_bytes(data)
    return wf.file_digest(str(path))


def test_large_files_are_sampled_header_and_windows(small_limits, tmp_path):
    data = bytes(range(256)) * 256  # 64 KiB
    base = sampled_digest(tmp_path, data)
    assert sampled_digest(tmp_path, data) == base
    span = len(data) - 4096 - 256
    in_window = 4096 + span * 3 // 7 + 10  # inside window 3
    for offset in (100, in_window, len(data) - 1):  # header, a window, the last window
        changed = bytearray(data)
        changed[offset] ^= 0xFF
        assert sampled_digest(tmp_path, bytes(changed)) != base, offset
    assert sampled_digest(tmp_path, data + b"\0") != base


def test_safetensors_header_is_hashed_whole(small_limits, tmp_path):
    header = b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}' + b" " * 6000 + b"}"
    data = len(header).to_bytes(8, "little") + header + bytes(64 * 1024)
    base = sampled_digest(tmp_path, data)
    changed = bytearray(data)
    changed[8 + 5000] = ord("x")  # past HEAD_BYTES, inside the JSON header
    assert sampled_digest(tmp_path, bytes(changed)) != base
