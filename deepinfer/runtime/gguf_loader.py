"""Load a llama.cpp GGUF file: config from metadata, HF-named dequantized weights, tokenizer.

Two llama.cpp conventions are undone here:
- GGUF lists tensor dims innermost-first (ne[0] = columns); `GGUFTensor.data` is already in
  row-major torch order, so only the *metadata* shapes are reversed.
- llama.cpp's HF converter permutes the rows of q_proj/k_proj (and their biases) for
  `llama`-arch models so its interleaved RoPE matches HF's rotate_half layout. We use the HF
  layout, so those rows are permuted back. Qwen2/Qwen3 GGUFs use NeoX RoPE in llama.cpp and
  are written unpermuted.
"""
from __future__ import annotations

import os
import re
import struct
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from deepinfer.models.model_config import ModelConfig
from deepinfer.quant.quantized_weight import QuantizedWeight
from deepinfer.runtime.gguf_file import GGUFFile
from deepinfer.models.registry import architecture_from_gguf

# GGUF block types computed natively (quantized_weight.py's formats); others are expanded.
NATIVE_TYPES = {GGMLQuantizationType.Q4_0: "q4_0", GGMLQuantizationType.Q4_1: "q4_1",
                GGMLQuantizationType.Q8_0: "q8_0", GGMLQuantizationType.Q4_K: "q4_k",
                GGMLQuantizationType.Q5_K: "q5_k", GGMLQuantizationType.Q6_K: "q6_k"}
# Architectures whose q/k rows llama.cpp's converter permuted (LlamaModel.permute).
_PERMUTED_QK_ARCHS = ("llama", "mistral")

# blk.N.<gguf name> -> model.layers.N.<hf name>
_LAYER_TENSOR_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Consumed into ModelConfig.rope_scaling rather than loaded as a parameter.
_ROPE_FREQS = "rope_freqs.weight"
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# Trailing quantization tag of a file name: ".Q4_1", "-Q4_K_M", "-IQ4_XS", ".f16", "-bf16" ...
_QUANT_SUFFIX_RE = re.compile(r"[.\-_](?:I?Q\d[A-Z0-9_]*|F16|F32|BF16)$", re.IGNORECASE)


def gguf_to_hf_name(name: str) -> str:
    """HF parameter name for a GGUF tensor name; ValueError if unknown."""
    if name in _GLOBAL_TENSOR_NAMES:
        return _GLOBAL_TENSOR_NAMES[name]
    m = _LAYER_RE.match(name)
    if m and m.group(2) in _LAYER_TENSOR_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_TENSOR_NAMES[m.group(2)]}.{m.group(3)}"
    raise ValueError(f"unsupported GGUF tensor {name!r}")


def unpermute_qk_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's `permute`: per head, rows [r0 r2 r4 .. r1 r3 ..] <- [r0 r1 r2 ..].

    llama.cpp stores each head's rows as (d/2, 2) pairs interleaved; HF keeps (2, d/2) halves."""
    rows = w.shape[0]
    head_dim = rows // num_heads
    return w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def dequantize_tensor(data: np.ndarray, qtype: GGMLQuantizationType) -> torch.Tensor:
    """GGUF tensor data -> torch tensor (float16/bfloat16/float32 kept native, quants -> float32)."""
    if qtype == GGMLQuantizationType.F32:
        return torch.from_numpy(np.array(data, dtype=np.float32))
    if qtype == GGMLQuantizationType.F16:
        return torch.from_numpy(np.array(data, dtype=np.float16))
    if qtype == GGMLQuantizationType.BF16:
        bits = np.ascontiguousarray(data).view(np.int16)  # raw bf16 bit patterns
        return torch.from_numpy(bits.copy()).view(torch.bfloat16)
    return torch.from_numpy(dequantize(data, qtype))


_PLAIN_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


def _native_weight(t, heads: int | None) -> QuantizedWeight:
    """A GGUF matrix's block bytes as a QuantizedWeight (rows un-permuted by row index:
    blocks run along a row, so a row permutation moves whole rows of bytes)."""
    rows, cols = t.shape
    data = torch.from_numpy(np.array(t.data, dtype=np.uint8))  # owned copy, [rows, row bytes]
    weight = QuantizedWeight(NATIVE_TYPES[t.tensor_type], rows, cols, data)
    if heads is None:
        return weight
    order = unpermute_qk_rows(torch.arange(rows), heads)
    return weight.select_rows(order)


def served_name_from_path(path: str) -> str:
    """'SmolLM2-135M-Instruct.Q4_1.gguf' -> 'SmolLM2-135M-Instruct'."""
    stem = os.path.basename(path)
    if stem.lower().endswith(".gguf"):
        stem = stem[: -len(".gguf")]
    return _QUANT_SUFFIX_RE.sub("", stem) or stem


class GGUFCheckpoint:
    """An open GGUF file (memory-mapped; tensors are dequantized lazily while iterating)."""

    def __init__(self, path: str):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"GGUF model file not found: {path}")
        try:
            self.file = GGUFFile(path)
        except (ValueError, struct.error, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read GGUF file {path}: {e}") from e
        self.path = path
        self.tensors = {t.name: t for t in self.file.tensors}
        self.gguf_architecture = self._field("general.architecture")
        self.config = self._build_config()

    # ---- metadata ---------------------------------------------------------------------

    def _field(self, key: str, default: Any = None) -> Any:
        return self.file.metadata.get(key, default)

    def _arch_field(self, key: str, default: Any = None) -> Any:
        return self._field(f"{self.gguf_architecture}.{key}", default)

    def _build_config(self) -> ModelConfig:
        if self.gguf_architecture is None:
            raise ValueError(f"{self.path}: GGUF has no general.architecture")
        arch = architecture_from_gguf(self.gguf_architecture)
        hidden = int(self._arch_field("embedding_length"))
        num_heads = int(self._arch_field("attention.head_count"))
        vocab = self._arch_field("vocab_size")
        if vocab is None:  # older files: vocab size is the token table or the embedding rows
            vocab = self.tensors["token_embd.weight"].shape[0]
        eos_ids = [self._field(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        return ModelConfig(
            architecture=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(self._arch_field("feed_forward_length")),
            num_hidden_layers=int(self._arch_field("block_count")),
            num_attention_heads=num_heads,
            num_key_value_heads=int(self._arch_field("attention.head_count_kv", num_heads)),
            head_dim=int(self._arch_field("attention.key_length", hidden // num_heads)),
            rms_norm_eps=float(self._arch_field("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(self._arch_field("rope.freq_base", 10000.0)),
            rope_scaling=self._rope_scaling(),
            max_position_embeddings=int(self._arch_field("context_length", 4096)),
            tie_word_embeddings="output.weight" not in self.tensors,
            attention_bias="blk.0.attn_q.bias" in self.tensors,
            qk_norm="blk.0.attn_q_norm.weight" in self.tensors,
            bos_token_id=self._field("tokenizer.ggml.bos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos_ids if e is not None)),
        )

    def _rope_scaling(self) -> dict[str, Any] | None:
        if _ROPE_FREQS in self.tensors:  # Llama 3.x: llama.cpp precomputes per-frequency factors
            t = self.tensors[_ROPE_FREQS]
            factors = dequantize_tensor(t.data, t.tensor_type).flatten()
            return {"rope_type": "freq_factors", "factors": tuple(float(f) for f in factors)}
        kind = self._arch_field("rope.scaling.type")
        if kind in (None, "none"):
            return None
        if kind == "linear":
            return {"rope_type": "linear", "factor": float(self._arch_field("rope.scaling.factor"))}
        raise ValueError(f"{self.path}: unsupported GGUF rope scaling {kind!r}")

    # ---- weights and tokenizer --------------------------------------------------------

    def quantized_types(self) -> set[str]:
        """Names of the block-quantized GGUF types of the file's weight matrices."""
        return {t.tensor_type.name for t in self.file.tensors
                if len(t.shape) == 2 and t.tensor_type not in _PLAIN_TYPES}

    def iter_weights(self, native: bool = False) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        """(HF name, tensor) for every parameter tensor, q/k rows restored to HF layout.
        `native`: matrices in a NATIVE_TYPES format come as `QuantizedWeight`s (their block
        bytes copied out of the file, no dequantization); the rest as tensors."""
        cfg = self.config
        permuted = cfg.architecture in _PERMUTED_QK_ARCHS and self.gguf_architecture in _PERMUTED_QK_ARCHS
        for t in self.file.tensors:
            if t.name == _ROPE_FREQS:
                continue
            name = gguf_to_hf_name(t.name)
            heads = None
            if permuted and ".self_attn.q_proj." in name:
                heads = cfg.num_attention_heads
            elif permuted and ".self_attn.k_proj." in name:
                heads = cfg.num_key_value_heads
            if native and len(t.shape) == 2 and t.tensor_type in NATIVE_TYPES:
                yield name, _native_weight(t, heads)
                continue
            tensor = dequantize_tensor(t.data, t.tensor_type)
            if heads is not None:
                tensor = unpermute_qk_rows(tensor, heads)
            yield name, tensor

    def load_tokenizer(self):
        """HF fast tokenizer (with chat template) converted from the GGUF vocabulary.

        Builds `PreTrainedTokenizerFast` from the file directly: `AutoTokenizer` would first
        load the whole model config through `gguf.GGUFReader` (seconds) just to pick the class,
        and GGUF vocabularies are always converted to the same fast backend anyway."""
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        directory, filename = os.path.split(os.path.abspath(self.path))
        try:
            tokenizer = PreTrainedTokenizerFast(gguf_file=filename, name_or_path=directory)
        except Exception:  # other transformers versions: take the documented slow path
            tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=filename)
        if tokenizer.chat_template is None:
            template = self._field("tokenizer.chat_template")
            if template is not None:
                tokenizer.chat_template = template
        return tokenizer

    @property
    def name(self) -> str:
        return served_name_from_path(self.path)

    def files(self) -> list[str]:
        """Every file the model is read from (weights, config and tokenizer: the one GGUF)."""
        return [self.path]
