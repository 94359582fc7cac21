"""The cluster secret's sources, and the tokenizer shipped as files (no pickle)."""
from __future__ import annotations

import os

import pytest

from deepinfer.wire import secret as wire_secret
from deepinfer.wire.tokenizer_files import (TokenizerFiles, tokenizer_from_files,
                                            tokenizer_to_files)


@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.delenv(wire_secret.SECRET_ENV, raising=False)
    return monkeypatch


def test_generated_secret_is_exported_for_children(clean_env):
    value = wire_secret.ensure_cluster_secret()
    assert len(value) == 64 and os.environ[wire_secret.SECRET_ENV] == value
    assert wire_secret.ensure_cluster_secret() == value  # stable within the process
    key = wire_secret.cluster_key()
    assert len(key) == 32 and value.encode() not in key


def test_secret_file_wins_and_is_validated(clean_env, tmp_path, caplog):
    path = tmp_path / "secret"
    path.write_text("  correct horse battery staple\n")
    path.chmod(0o600)
    clean_env.setenv(wire_secret.SECRET_ENV, "another secret of enough length")
    assert wire_secret.ensure_cluster_secret(str(path)) == "correct horse battery staple"
    assert os.environ[wire_secret.SECRET_ENV] == "correct horse battery staple"
    path.chmod(0o644)
    with caplog.at_level("WARNING"):
        wire_secret.ensure_cluster_secret(str(path))
    assert "readable by other users" in caplog.text
    path.write_text("short")
    with pytest.raises(wire_secret.ClusterSecretError, match="at least"):
        wire_secret.ensure_cluster_secret(str(path))
    path.write_bytes(b"\xff\xfe" * 20)
    with pytest.raises(wire_secret.ClusterSecretError, match="UTF-8"):
        wire_secret.ensure_cluster_secret(str(path))
    with pytest.raises(wire_secret.ClusterSecretError, match="cannot read"):
        wire_secret.ensure_cluster_secret(str(tmp_path / "missing"))


def test_different_secrets_give_different_keys(clean_env):
    clean_env.setenv(wire_secret.SECRET_ENV, "a" * 32)
    first = wire_secret.cluster_key()
    clean_env.setenv(wire_secret.SECRET_ENV, "b" * 32)
    assert wire_secret.cluster_key() != first
    assert wire_secret.key_id(first) != wire_secret.key_id(wire_secret.cluster_key())


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(
        ["<unk>", "<s>", "</s>", "hello", "world", "user", "assistant", ":", "!"])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        chat_template="{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} "
                      "{% endfor %}")


def test_tokenizer_files_rebuild_the_same_tokenizer():
    import msgspec

    original = _tiny_tokenizer()
    shipped = tokenizer_to_files(original)
    assert all("/" not in name for name in shipped.files)
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(shipped), type=TokenizerFiles)
    rebuilt = tokenizer_from_files(wire)
    messages = [{"role": "user", "content": "hello world !"}]
    assert rebuilt.apply_chat_template(messages, tokenize=False) == \
        original.apply_chat_template(messages, tokenize=False)
    assert rebuilt("hello world ! zzz").input_ids == original("hello world ! zzz").input_ids
    assert rebuilt.eos_token_id == original.eos_token_id == 2


@pytest.mark.parametrize("files,match", [
    ({}, "no tokenizer files"),
    ({"../evil.json": b"{}"}, "unexpected"),
    ({"tokenization_evil.py": b"import os"}, "unexpected"),
    ({".hidden": b""}, "unexpected"),
])
def test_hostile_tokenizer_files_are_refused(files, match):
    with pytest.raises(ValueError, match=match):
        tokenizer_from_files(TokenizerFiles(files))
