"""Idefics3 (SmolVLM): a SigLIP-style tower with a post-norm, a pixel-shuffle connector and a
Llama-family language model (SmolLM2).

Its processor splits each image into crops of the tower's size plus one downscaled global
view; every crop becomes its own contiguous run of `image_seq_len` image tokens. Each crop is
therefore one "image" of the engine's seam (placeholder, embedding cache entry):

    crop [3, S, S] -> tower -> post-norm [(S/p)^2, d]
      -> pixel shuffle (each r x r patch neighbourhood concatenated) [(S/p)^2 / r^2, d r^2]
      -> linear (no bias) [(S/p)^2 / r^2, hidden]
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

from deepinfer.layers.empty_init import uninitialized
from deepinfer.models.llama import LlamaForCausalLM
from deepinfer.models.llava import load_vision_language_weights, renamed_by_prefix
from deepinfer.models.model_config import ModelConfig
from deepinfer.models.vision_tower import VisionTowerConfig, VisionTransformer

_VISION_PREFIXES = (("model.vision_model.", "vision_model."), ("model.connector.", "connector."))
_LANGUAGE_PREFIXES = (("model.text_model.", "model."),)


def pixel_shuffle(x: Tensor, scale: int) -> Tensor:
    """[N, side*side, d] -> [N, side*side / scale^2, d * scale^2], as HF's Idefics3Connector."""
    n, seq, d = x.shape
    side = int(seq ** 0.5)
    x = x.view(n, side, side // scale, d * scale)
    x = x.permute(0, 2, 1, 3).reshape(n, side // scale, side // scale, d * scale * scale)
    return x.permute(0, 2, 1, 3).reshape(n, seq // (scale * scale), d * scale * scale)


class Idefics3Projection(nn.Module):
    def __init__(self, in_features: int, hidden: int, dtype: torch.dtype):
        super().__init__()
        self.proj = uninitialized(nn.Linear, in_features, hidden, bias=False, dtype=dtype)


class Idefics3Connector(nn.Module):
    def __init__(self, in_features: int, hidden: int, dtype: torch.dtype):
        super().__init__()
        self.modality_projection = Idefics3Projection(in_features, hidden, dtype)


class Idefics3ForConditionalGeneration(LlamaForCausalLM):
    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32):
        super().__init__(config, dtype)
        hf = config.vision_language or {}
        tower = VisionTowerConfig.from_hf({"model_type": "idefics3_vision", **(hf.get("vision_config") or {})})
        if tower.model_type != "idefics3_vision":
            raise ValueError(f"Idefics3 expects an idefics3_vision tower, got {tower.model_type!r}")
        self.tower_config = tower
        self.scale_factor = int(hf.get("scale_factor", 2))
        side = tower.image_size // tower.patch_size
        if side % self.scale_factor:
            raise ValueError(f"scale_factor {self.scale_factor} does not divide {side} patches per side")
        if hf.get("image_token_id") is None:
            raise ValueError("the Idefics3 config names no image_token_id")
        self._image_token_id = int(hf["image_token_id"])
        self.vision_model = VisionTransformer(tower, tower.num_hidden_layers, dtype, post_norm=True)
        self.connector = Idefics3Connector(tower.hidden_size * self.scale_factor ** 2, config.hidden_size, dtype)
        self.requires_grad_(False)

    @property
    def image_token_id(self) -> int:
        return self._image_token_id

    def num_image_tokens(self) -> int:
        """Embedding rows per crop."""
        return self.tower_config.num_patches // self.scale_factor ** 2

    def image_pixel_shape(self) -> tuple[int, int, int]:
        t = self.tower_config
        return (t.num_channels, t.image_size, t.image_size)

    @torch.inference_mode()
    def encode_images(self, pixel_values: Tensor) -> Tensor:
        """Crops [N, 3, S, S] -> embeddings [N, image_seq_len, hidden] (model dtype)."""
        hidden = self.vision_model.hidden_states(pixel_values, [-1])[0]  # [N, patches, d]
        hidden = self.vision_model.post_layernorm(hidden)
        return self.connector.modality_projection.proj(pixel_shuffle(hidden, self.scale_factor))

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        load_vision_language_weights(self, weights, self._vision_target, self._language_name,
                                     ("vision_model.", "connector."))

    @staticmethod
    def _vision_target(name: str) -> str | None:
        return renamed_by_prefix(name, _VISION_PREFIXES)

    @staticmethod
    def _language_name(name: str) -> str:
        return renamed_by_prefix(name, _LANGUAGE_PREFIXES) or name
