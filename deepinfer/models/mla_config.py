"""Multi-head latent attention (MLA) hyper-parameters of DeepSeek-V2/V3. Pure: stdlib only,
parsed from a Hugging Face `config.json` dict."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MLAConfig:
    """DeepSeek multi-head latent attention.

    Per token the cache keeps the normalised latent `c_kv` [kv_lora_rank] and the shared,
    roped key `k_pe` [qk_rope_head_dim]; per-head keys/values are `kv_b_proj(c_kv)`.
    `softmax_scale` already includes YaRN's mscale² correction.
    """

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    softmax_scale: float

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_entry_dim(self) -> int:
        """Values one token occupies per layer in the latent cache."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def mla_config_from_hf(cfg: dict[str, Any], rope_scaling: dict[str, Any] | None) -> MLAConfig:
    q_lora = cfg.get("q_lora_rank")
    nope, rope = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"])
    if rope % 2:
        raise ValueError(f"qk_rope_head_dim must be even, got {rope}")
    scale = (nope + rope) ** -0.5
    if rope_scaling is not None:  # DeepSeek: softmax scale *= mscale(factor, mscale_all_dim)²
        mscale_all_dim = rope_scaling.get("mscale_all_dim") or 0
        if mscale_all_dim:
            m = yarn_get_mscale(float(rope_scaling["factor"]), float(mscale_all_dim))
            scale *= m * m
    return MLAConfig(
        q_lora_rank=None if q_lora is None else int(q_lora),
        kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=int(cfg["v_head_dim"]),
        rope_interleave=bool(cfg.get("rope_interleave", True)),
        softmax_scale=scale)
