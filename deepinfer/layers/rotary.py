"""Rotary position embedding (HF / NeoX "rotate_half" layout) with a prebuilt cos/sin table.

The table covers every position up to `max_position_embeddings` and is built once at model
construction, so a forward only gathers rows by position (no per-call trig or allocation of
tables). Supported `rope_scaling` types: None/default, "linear", "llama3", "yarn" (DeepSeek-V3,
Qwen long context: blended frequencies and an attention factor folded into cos/sin), and
"freq_factors" (llama.cpp's `rope_freqs` tensor: per-frequency divisors, as stored in Llama 3.x
GGUFs). `apply_rotary_interleaved` is DeepSeek's pairwise (x0, x1), (x2, x3)... layout.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn


def compute_inv_freq(head_dim: int, rope_theta: float, rope_scaling: dict[str, Any] | None) -> Tensor:
    """Inverse frequencies [head_dim // 2] in float32, after any rope scaling."""
    inv_freq = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope_scaling is None:
        return inv_freq
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(rope_scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope_scaling)
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, rope_theta, rope_scaling)
    if rope_type == "freq_factors":
        factors = torch.tensor(rope_scaling["factors"], dtype=torch.float32)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"rope freq_factors has {factors.numel()} entries, expected {inv_freq.numel()}")
        return inv_freq / factors
    raise ValueError(f"unsupported rope_scaling type {rope_type!r} (supported: default, linear, llama3, yarn)")


def _yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_attention_factor(rope_scaling: dict[str, Any] | None) -> float:
    """The factor YaRN multiplies cos and sin by (1.0 for every other rope type)."""
    if rope_scaling is None or rope_scaling.get("rope_type", rope_scaling.get("type")) != "yarn":
        return 1.0
    if rope_scaling.get("attention_factor") is not None:
        return float(rope_scaling["attention_factor"])
    factor = float(rope_scaling["factor"])
    mscale, mscale_all_dim = rope_scaling.get("mscale"), rope_scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_get_mscale(factor, float(mscale)) / _yarn_get_mscale(factor, float(mscale_all_dim))
    return _yarn_get_mscale(factor)


def _yarn_inv_freq(dim: int, base: float, scaling: dict[str, Any]) -> Tensor:
    """YaRN: extrapolate high frequencies, interpolate (divide by factor) low ones, with a
    linear ramp between the dimensions that rotate beta_fast and beta_slow times."""
    if scaling.get("factor") is None or scaling.get("original_max_position_embeddings") is None:
        raise ValueError("yarn rope_scaling needs 'factor' and 'original_max_position_embeddings'")
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _llama3_inv_freq(inv_freq: Tensor, scaling: dict[str, Any]) -> Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """The cos/sin table; `cos_sin(positions)` gathers rows once per forward for all layers."""

    def __init__(
        self,
        head_dim: int,
        max_position_embeddings: int,
        rope_theta: float,
        rope_scaling: dict[str, Any] | None,
        dtype: torch.dtype,
    ):
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_position_embeddings
        inv_freq = compute_inv_freq(head_dim, rope_theta, rope_scaling)
        t = torch.arange(max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_pos, d/2], float32 like HF
        scale = rope_attention_factor(rope_scaling)  # YaRN scales cos and sin alike
        # [max_pos, d] = cos | sin, cast once to the model dtype (HF casts cos/sin before use).
        table = torch.cat((freqs.cos() * scale, freqs.sin() * scale), dim=-1)
        self.register_buffer("cos_sin_cache", table.to(dtype), persistent=False)

    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """positions [T] -> cos, sin each [T, 1, d/2] (broadcast over heads)."""
        cos_sin = self.cos_sin_cache.index_select(0, positions).unsqueeze(1)  # [T, 1, d]
        return cos_sin.chunk(2, dim=-1)

    def forward(self, positions: Tensor, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """Rotate q [T, H, d] and k [T, KV, d] (convenience; the model shares `cos_sin`)."""
        cos, sin = self.cos_sin(positions)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, heads, d] -> x*cos + rotate_half(x)*sin, halves written out (no full-width cos/sin)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def apply_rotary_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """DeepSeek's layout: pairs (x[2i], x[2i+1]) share frequency i. The output is written
    de-interleaved (rotated evens | rotated odds), as the reference does; queries and keys get
    the same permutation, so their dot products are unchanged."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
