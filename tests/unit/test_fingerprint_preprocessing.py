"""The store salts (KV blocks and image embeddings) cover a checkpoint's image-processor
configs: equal weights with other preprocessing give other embeddings, so must not share."""
from __future__ import annotations

import shutil

from deepinfer.multimodal.embedding_store import embedding_store_salt
from deepinfer.runtime.weights_fingerprint import weights_fingerprint

PREPROCESSING_FILES = ("preprocessor_config.json", "processor_config.json")


def _checkpoint(directory):
    directory.mkdir(parents=True)
    (directory / "model.safetensors").write_bytes(b"weights" * 100)
    (directory / "config.json").write_text('{"model_type": "llava"}')
    return directory


def _fingerprint(directory) -> str:
    # What HFCheckpoint.files() names: weights and config, not the processor files.
    return weights_fingerprint(str(directory), [str(directory / "model.safetensors"),
                                                str(directory / "config.json")])


def test_processor_configs_change_the_fingerprint_and_embedding_salt(tmp_path):
    base = _checkpoint(tmp_path / "base" / "m")
    plain = _fingerprint(base)
    for name in PREPROCESSING_FILES:
        a = shutil.copytree(base, tmp_path / f"a-{name}" / "m")
        b = shutil.copytree(base, tmp_path / f"b-{name}" / "m")
        (a / name).write_text('{"image_mean": [0.5, 0.5, 0.5], "size": {"height": 30}}')
        (b / name).write_text('{"image_mean": [0.4, 0.4, 0.4], "size": {"height": 30}}')
        fa, fb = _fingerprint(a), _fingerprint(b)
        assert len({plain, fa, fb}) == 3, name
        assert embedding_store_salt(fa) != embedding_store_salt(fb)
        # Same files in another folder: same fingerprint (content, not path).
        assert _fingerprint(shutil.copytree(a, tmp_path / f"c-{name}" / "renamed")) == fa


def test_processor_config_named_by_the_caller_is_hashed_once(tmp_path):
    d = _checkpoint(tmp_path / "m")
    (d / "preprocessor_config.json").write_text("{}")
    files = [str(d / "model.safetensors"), str(d / "config.json")]
    assert weights_fingerprint(str(d), files + [str(d / "preprocessor_config.json")]) \
        == weights_fingerprint(str(d), files)
