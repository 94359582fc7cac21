"""LLaVA: a CLIP or SigLIP vision tower, a two-layer projector, and a Llama-family language model.

    pixels [N, 3, H, W] -> tower hidden states at `vision_feature_layer` (a list: concatenated)
      -> drop the CLS row when `vision_feature_select_strategy` == "default"
      -> projector (linear, act, linear) -> image embeddings [N, tokens, hidden]

The language side is `LlamaForCausalLM` itself (this class extends it), so the runner, the
LM head, weight packing and the KV cache see an ordinary decoder; image embeddings reach it as
rows of `input_embeds` at the image-token positions (deepinfer.multimodal.embed_splice).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deepinfer.layers.empty_init import uninitialized
from deepinfer.models.llama import LlamaForCausalLM
from deepinfer.models.model_config import ModelConfig
from deepinfer.models.vision_tower import VisionTowerConfig, VisionTransformer, feature_layer_index
from deepinfer.models.weight_mapping import load_hf_named_weights

_VISION_PREFIXES = ("model.vision_tower.vision_model.", "model.vision_tower.",
                    "vision_tower.vision_model.", "vision_tower.")
_PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")
# transformers < 5 / >= 5 checkpoint names of the language model -> LlamaForCausalLM names.
_LANGUAGE_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                      ("language_model.lm_head.", "lm_head."))


@dataclass(frozen=True)
class LlavaVisionConfig:
    tower: VisionTowerConfig
    feature_layers: tuple[int, ...]
    concat_layers: bool  # vision_feature_layer was a list
    select_strategy: str  # "default" (drop CLS) | "full"
    projector_act: str
    projector_bias: bool
    image_token_id: int

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "LlavaVisionConfig":
        layer = cfg.get("vision_feature_layer", -2)
        strategy = cfg.get("vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise ValueError(f"unsupported vision_feature_select_strategy {strategy!r}")
        image_token = cfg.get("image_token_id", cfg.get("image_token_index"))
        if image_token is None:
            raise ValueError("the LLaVA config names no image_token_index")
        return cls(
            tower=VisionTowerConfig.from_hf(cfg.get("vision_config") or {}),
            feature_layers=tuple(layer) if isinstance(layer, (list, tuple)) else (int(layer),),
            concat_layers=isinstance(layer, (list, tuple)),
            select_strategy=strategy,
            projector_act=cfg.get("projector_hidden_act", "gelu"),
            projector_bias=bool(cfg.get("multimodal_projector_bias", True)),
            image_token_id=int(image_token),
        )


class LlavaProjector(nn.Module):
    def __init__(self, in_features: int, hidden: int, act: str, bias: bool, dtype: torch.dtype):
        super().__init__()
        if act not in ("gelu", "gelu_pytorch_tanh", "silu"):
            raise ValueError(f"unsupported projector_hidden_act {act!r}")
        self.act = act
        self.linear_1 = uninitialized(nn.Linear, in_features, hidden, bias=bias, dtype=dtype)
        self.linear_2 = uninitialized(nn.Linear, hidden, hidden, bias=bias, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        x = self.linear_1(x)
        if self.act == "silu":
            x = F.silu(x)
        else:
            x = F.gelu(x, approximate="tanh" if self.act == "gelu_pytorch_tanh" else "none")
        return self.linear_2(x)


class LlavaForConditionalGeneration(LlamaForCausalLM):
    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32):
        super().__init__(config, dtype)
        if config.vision_language is None:
            raise ValueError("LlavaForConditionalGeneration needs a vision-language config")
        self.vision_config = vision = LlavaVisionConfig.from_hf(config.vision_language)
        tower = vision.tower
        self._num_tower_layers = max(
            feature_layer_index(i, tower.num_hidden_layers) for i in vision.feature_layers)
        self.vision_tower = VisionTransformer(tower, self._num_tower_layers, dtype)
        self.multi_modal_projector = LlavaProjector(
            tower.hidden_size * len(vision.feature_layers), config.hidden_size,
            vision.projector_act, vision.projector_bias, dtype)
        self.requires_grad_(False)

    @property
    def image_token_id(self) -> int:
        return self.vision_config.image_token_id

    def image_pixel_shape(self) -> tuple[int, int, int]:
        """The [C, H, W] of one preprocessed image."""
        tower = self.vision_config.tower
        return (tower.num_channels, tower.image_size, tower.image_size)

    def num_image_tokens(self) -> int:
        """Embedding rows per image (every image is resized to the tower's size)."""
        drop_cls = self.vision_config.select_strategy == "default"
        return self.vision_config.tower.num_positions - int(drop_cls)

    @torch.inference_mode()
    def encode_images(self, pixel_values: Tensor) -> Tensor:
        """pixel_values [N, 3, H, W] -> image embeddings [N, tokens, hidden] (model dtype)."""
        vision = self.vision_config
        states = self.vision_tower.hidden_states(pixel_values, list(vision.feature_layers))
        if vision.select_strategy == "default":
            states = [s[:, 1:] for s in states]  # drop the CLS row (HF does so for any tower)
        features = torch.cat(states, dim=-1) if len(states) > 1 else states[0]  # [N, T, d * layers]
        return self.multi_modal_projector(features)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Language tensors go through the Llama loader; tower and projector tensors map
        one-to-one (tower layers past the deepest used one, its post-norm and pooling head
        are skipped). Raises ValueError on unknown names, wrong shapes or unfilled weights."""
        load_vision_language_weights(self, weights, self._vision_target, self._language_name,
                                     ("vision_tower.", "multi_modal_projector."))

    def _vision_target(self, name: str) -> str | None:
        """Our parameter name for a tower/projector tensor, "" for one to skip, None if the
        tensor belongs to the language model."""
        for prefix in _PROJECTOR_PREFIXES:
            if name.startswith(prefix):
                return "multi_modal_projector." + name[len(prefix):]
        for prefix in _VISION_PREFIXES:
            if name.startswith(prefix):
                rest = name[len(prefix):]
                if rest.startswith(("post_layernorm.", "head.")):
                    return ""
                if rest.startswith("encoder.layers."):
                    if int(rest.split(".")[2]) >= self._num_tower_layers:
                        return ""
                return "vision_tower." + rest
        return None

    @staticmethod
    def _language_name(name: str) -> str:
        return renamed_by_prefix(name, _LANGUAGE_PREFIXES) or name



def renamed_by_prefix(name: str, prefixes: Iterable[tuple[str, str]]) -> str | None:
    """`name` with the first matching (old, new) prefix replaced; None if none matches."""
    for old, new in prefixes:
        if name.startswith(old):
            return new + name[len(old):]
    return None


def load_vision_language_weights(model: nn.Module, weights: Iterable[tuple[str, Tensor]],
                                 vision_target: Callable[[str], str | None],
                                 language_name: Callable[[str], str], vision_prefixes: tuple[str, ...]) -> None:
    """Language tensors (vision_target(name) is None) go through the Llama loader under
    language_name(name); vision tensors map to our parameter vision_target(name) ("" = skip).
    Raises ValueError on unknown names, wrong shapes or unfilled weights."""
    params = {n: p for n, p in model.named_parameters() if n.startswith(vision_prefixes)}
    filled: set[str] = set()

    def language():
        for name, tensor in weights:
            target = vision_target(name)
            if target is None:
                yield language_name(name), tensor
                continue
            if not target:
                continue
            param = params.get(target)
            if param is None:
                raise ValueError(f"unexpected checkpoint tensor {name!r} for a {type(model).__name__} model")
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(tensor)
            filled.add(target)

    load_hf_named_weights(model, language(), skip_prefixes=vision_prefixes)
    missing = sorted(set(params) - filled)
    if missing:
        raise ValueError(f"checkpoint is missing weights for: {', '.join(missing[:5])}")
