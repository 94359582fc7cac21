"""Architecture names (HF `architectures`, GGUF `general.architecture`, ours) -> model class."""
from __future__ import annotations

from torch import nn

from deepinfer.models.llama import LlamaForCausalLM
from deepinfer.models.model_config import HF_ARCHITECTURES, ModelConfig

# Our architecture names (ModelConfig.architecture) -> class.
_MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "mixtral": LlamaForCausalLM,  # Llama attention + sparse MoE MLP (layers built by build_mlp)
    "qwen3_moe": LlamaForCausalLM,
}


def _deepseek_v3_class() -> type[nn.Module]:
    from deepinfer.models.deepseek_v3 import DeepseekV3ForCausalLM
    return DeepseekV3ForCausalLM

# GGUF `general.architecture` -> our architecture name (llama.cpp writes Mistral as "llama").
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
}


def _unsupported(kind: str, name: str, known: dict[str, str]) -> ValueError:
    return ValueError(f"unsupported {kind} architecture {name!r}; supported: {', '.join(sorted(known))}")


def architecture_from_hf(name: str) -> str:
    if name not in HF_ARCHITECTURES:
        raise _unsupported("Hugging Face", name, HF_ARCHITECTURES)
    return HF_ARCHITECTURES[name]


def architecture_from_gguf(name: str) -> str:
    if name not in GGUF_ARCHITECTURES:
        raise _unsupported("GGUF", name, GGUF_ARCHITECTURES)
    return GGUF_ARCHITECTURES[name]


def get_model_class(architecture: str) -> type[nn.Module]:
    """Class for our architecture name, an HF `architectures` entry or a GGUF architecture."""
    arch = HF_ARCHITECTURES.get(architecture, architecture)
    if arch in ("deepseek_v2", "deepseek_v3"):  # same modules; V2 differs in routing config only
        return _deepseek_v3_class()
    if arch not in _MODEL_CLASSES:
        raise _unsupported("model", architecture, {**_MODEL_CLASSES, **HF_ARCHITECTURES})
    return _MODEL_CLASSES[arch]


def build_model(config: ModelConfig, dtype) -> nn.Module:
    """An unloaded model for `config` (call `load_weights` next)."""
    if config.vision_language is not None:  # a vision tower in front of the decoder
        if "Idefics3ForConditionalGeneration" in (config.vision_language.get("architectures") or ()):
            from deepinfer.models.idefics3 import Idefics3ForConditionalGeneration
            return Idefics3ForConditionalGeneration(config, dtype=dtype)
        from deepinfer.models.llava import LlavaForConditionalGeneration
        return LlavaForConditionalGeneration(config, dtype=dtype)
    return get_model_class(config.architecture)(config, dtype=dtype)
