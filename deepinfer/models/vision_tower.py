"""CLIP and SigLIP vision transformers, as LLaVA uses them: patch embeddings, then pre-norm
encoder layers; LLaVA reads the hidden states after one (or several) of the layers.

Module names follow Hugging Face's `CLIPVisionTransformer` / `SiglipVisionTransformer` so
checkpoint names map one-to-one. The two differ only in:

    CLIP    patch conv without bias, a learned CLS token first, `pre_layrnorm` before layer 0
    SigLIP  patch conv with bias, no CLS token, no pre-norm (its pooling head is not used)
    Idefics3  SigLIP's layers; position ids bucketed by fractional patch coordinates (for
            the full, unpadded crops its processor makes they are 0..patches-1, computed the
            same way), and a post-norm that Idefics3 reads (`post_norm=True`)

Pooling heads and the post-norm are never used by LLaVA and are not built.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deepinfer.layers.empty_init import uninitialized

VISION_MODEL_TYPES = ("clip_vision_model", "siglip_vision_model", "idefics3_vision")


@dataclass(frozen=True)
class VisionTowerConfig:
    model_type: str  # one of VISION_MODEL_TYPES
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "VisionTowerConfig":
        model_type = cfg.get("model_type", "clip_vision_model")
        if model_type not in VISION_MODEL_TYPES:
            raise ValueError(f"unsupported vision tower {model_type!r}; supported: {', '.join(VISION_MODEL_TYPES)}")
        clip = model_type == "clip_vision_model"
        return cls(
            model_type=model_type,
            hidden_size=int(cfg.get("hidden_size", 768)),
            intermediate_size=int(cfg.get("intermediate_size", 3072)),
            num_hidden_layers=int(cfg.get("num_hidden_layers", 12)),
            num_attention_heads=int(cfg.get("num_attention_heads", 12)),
            image_size=int(cfg.get("image_size", 224)),
            patch_size=int(cfg.get("patch_size", 32 if clip else 16)),
            num_channels=int(cfg.get("num_channels", 3)),
            layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-5 if clip else 1e-6)),
            hidden_act=cfg.get("hidden_act", "quick_gelu" if clip else "gelu_pytorch_tanh"),
        )

    @property
    def has_cls_token(self) -> bool:
        return self.model_type == "clip_vision_model"

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_positions(self) -> int:
        return self.num_patches + int(self.has_cls_token)


def _activation(name: str):
    if name == "quick_gelu":
        return lambda x: x * torch.sigmoid(1.702 * x)
    if name in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    raise ValueError(f"unsupported vision activation {name!r}")


def feature_layer_index(index: int, num_layers: int) -> int:
    """HF hidden_states index (negative from the end) -> 0 (embeddings) .. num_layers."""
    absolute = index + num_layers + 1 if index < 0 else index
    if not 0 <= absolute <= num_layers:
        raise ValueError(f"vision_feature_layer {index} is out of range for {num_layers} layers")
    return absolute


class VisionEmbeddings(nn.Module):
    def __init__(self, config: VisionTowerConfig, dtype: torch.dtype):
        super().__init__()
        self.config = config
        d = config.hidden_size
        self.patch_embedding = uninitialized(
            nn.Conv2d, config.num_channels, d, kernel_size=config.patch_size, stride=config.patch_size,
            bias=not config.has_cls_token, dtype=dtype)
        if config.has_cls_token:
            self.class_embedding = nn.Parameter(torch.empty(d, dtype=dtype))
        self.position_embedding = uninitialized(nn.Embedding, config.num_positions, d, dtype=dtype)

    def _position_ids(self, device) -> Tensor:
        """Idefics3's bucketed ids for an unpadded image, with HF's float arithmetic."""
        side = self.config.image_size // self.config.patch_size
        boundaries = torch.arange(1 / side, 1.0, 1 / side, device=device)
        step = 1.0 / torch.tensor([side], device=device)
        frac = torch.arange(side, device=device, dtype=torch.float32)[None, :] * step[:, None]
        buckets = torch.bucketize(frac.clamp(max=1.0 - 1e-6), boundaries, right=True)[0]  # [side]
        return (buckets[:, None] * side + buckets[None, :]).reshape(-1)

    def forward(self, pixel_values: Tensor) -> Tensor:
        size = self.config.image_size
        if tuple(pixel_values.shape[-2:]) != (size, size):
            raise ValueError(f"pixel_values are {tuple(pixel_values.shape[-2:])}, the tower expects {size}x{size}")
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(weight.dtype))  # [N, d, h, w]
        x = patches.flatten(2).transpose(1, 2)  # [N, h*w, d]
        if self.config.has_cls_token:
            cls = self.class_embedding.expand(x.shape[0], 1, -1)
            x = torch.cat([cls, x], dim=1)  # [N, 1 + h*w, d]
        if self.config.model_type == "idefics3_vision":
            return x + self.position_embedding(self._position_ids(x.device))
        return x + self.position_embedding.weight


class VisionAttention(nn.Module):
    def __init__(self, config: VisionTowerConfig, dtype: torch.dtype):
        super().__init__()
        d = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = d // self.num_heads
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            setattr(self, name, uninitialized(nn.Linear, d, d, bias=True, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        n, t, d = x.shape
        q, k, v = (proj(x).view(n, t, self.num_heads, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))  # [N, H, T, hd] each
        out = F.scaled_dot_product_attention(q, k, v)  # every patch attends to every patch
        return self.out_proj(out.transpose(1, 2).reshape(n, t, d))


class VisionMLP(nn.Module):
    def __init__(self, config: VisionTowerConfig, dtype: torch.dtype):
        super().__init__()
        self.act = _activation(config.hidden_act)
        self.fc1 = uninitialized(nn.Linear, config.hidden_size, config.intermediate_size, dtype=dtype)
        self.fc2 = uninitialized(nn.Linear, config.intermediate_size, config.hidden_size, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionEncoderLayer(nn.Module):
    def __init__(self, config: VisionTowerConfig, dtype: torch.dtype):
        super().__init__()
        eps, d = config.layer_norm_eps, config.hidden_size
        self.layer_norm1 = uninitialized(nn.LayerNorm, d, eps=eps, dtype=dtype)
        self.self_attn = VisionAttention(config, dtype)
        self.layer_norm2 = uninitialized(nn.LayerNorm, d, eps=eps, dtype=dtype)
        self.mlp = VisionMLP(config, dtype)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, config: VisionTowerConfig, num_layers: int, dtype: torch.dtype):
        super().__init__()
        self.layers = nn.ModuleList(VisionEncoderLayer(config, dtype) for _ in range(num_layers))


class VisionTransformer(nn.Module):
    """`hidden_states(pixel_values, indices)` -> HF's `hidden_states[i]` for each index
    (0 = the embeddings after the pre-norm, i = after layer i; negative from the end).

    Only the layers up to the deepest index used are built and run (`num_layers_used`)."""

    def __init__(self, config: VisionTowerConfig, num_layers_used: int, dtype: torch.dtype,
                 post_norm: bool = False):
        super().__init__()
        self.config = config
        self.embeddings = VisionEmbeddings(config, dtype)
        if config.has_cls_token:
            self.pre_layrnorm = uninitialized(nn.LayerNorm, config.hidden_size,
                                              eps=config.layer_norm_eps, dtype=dtype)
        self.encoder = VisionEncoder(config, num_layers_used, dtype)
        if post_norm:
            self.post_layernorm = uninitialized(nn.LayerNorm, config.hidden_size,
                                                eps=config.layer_norm_eps, dtype=dtype)

    def hidden_states(self, pixel_values: Tensor, indices: list[int]) -> list[Tensor]:
        wanted = [feature_layer_index(i, self.config.num_hidden_layers) for i in indices]
        x = self.embeddings(pixel_values)  # [N, T, d]
        if self.config.has_cls_token:
            x = self.pre_layrnorm(x)
        states = [x]
        for layer in self.encoder.layers[:max(wanted)]:
            x = layer(x)
            states.append(x)
        return [states[i] for i in wanted]
