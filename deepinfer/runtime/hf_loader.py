"""Load a Hugging Face model directory: config.json, *.safetensors (single or sharded), tokenizer."""
from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open

from deepinfer.models.model_config import ModelConfig

_INDEX_FILE = "model.safetensors.index.json"
_SINGLE_FILE = "model.safetensors"
# Config and tokenizer files that change what a checkpoint computes (its fingerprint's inputs).
_CONFIG_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "tokenizer.model", "special_tokens_map.json", "added_tokens.json", "vocab.json",
                 "merges.txt", "chat_template.jinja")


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e


def safetensors_files(directory: str) -> list[str]:
    """The weight files of `directory`, from the shard index when there is one."""
    index_path = os.path.join(directory, _INDEX_FILE)
    if os.path.isfile(index_path):
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index_path} has no weight_map")
        files = sorted(set(weight_map.values()))
    elif os.path.isfile(os.path.join(directory, _SINGLE_FILE)):
        files = [_SINGLE_FILE]
    else:
        files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {directory}")
    paths = [os.path.join(directory, f) for f in files]
    for p in paths:
        if not os.path.isfile(p):
            raise FileNotFoundError(f"weight shard listed in the index is missing: {p}")
    return paths


class HFCheckpoint:
    """A Hugging Face model directory (safetensors weights only; no pickled .bin files)."""

    def __init__(self, directory: str):
        config_path = os.path.join(directory, "config.json")
        if not os.path.isfile(config_path):
            raise FileNotFoundError(f"not a Hugging Face model directory (no config.json): {directory}")
        self.path = directory
        hf_config = _read_json(config_path)
        # generation_config.json often lists extra stop ids (e.g. Llama 3 <|eot_id|>).
        gen_path = os.path.join(directory, "generation_config.json")
        if os.path.isfile(gen_path):
            gen_eos = _read_json(gen_path).get("eos_token_id")
            if gen_eos is not None:
                hf_config = {**hf_config, "eos_token_id": _merge_ids(hf_config.get("eos_token_id"), gen_eos)}
        self.config = ModelConfig.from_hf_config(hf_config)
        self.weight_files = safetensors_files(directory)

    @property
    def name(self) -> str:
        return os.path.basename(os.path.normpath(self.path))

    def files(self) -> list[str]:
        """Every file the model is read from: weight shards, config and tokenizer files."""
        extra = [os.path.join(self.path, f) for f in _CONFIG_FILES]
        return self.weight_files + [p for p in extra if os.path.isfile(p)]

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) in the checkpoint's own dtype, one shard open at a time."""
        for path in self.weight_files:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

    def load_tokenizer(self):
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(self.path)
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot load a tokenizer from {self.path}: {e}") from e


def _merge_ids(a, b) -> list[int]:
    ids: list[int] = []
    for x in (a, b):
        for i in (x if isinstance(x, (list, tuple)) else [x]):
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    return ids
