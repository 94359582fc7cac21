"""The few numbers of a model that its step cost depends on. Pure: stdlib only.

A `ModelShape` is what the cost model multiplies its features by: how many FLOPs a token costs in
the linear layers, how many in attention per (query, key) pair, how many bytes a step reads.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    """Sizes of a decoder-only transformer, as far as step cost is concerned.

    `active_params`: parameters one token passes through in the linear layers (attention
    projections + MLP, or the routed top-k experts + shared experts for MoE); embeddings and the
    LM head are left out because the head runs only on sampled positions (a per-request cost).
    `kv_bytes_per_token`: K and V bytes of one token over all layers.
    `weight_bytes`: bytes of all weights, read once per step.
    """

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    active_params: int
    kv_bytes_per_token: int
    weight_bytes: int

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if value < 0 or (value == 0 and name != "weight_bytes"):
                raise ValueError(f"ModelShape.{name} must be positive, got {value}")

    @property
    def attention_flops_per_pair(self) -> int:
        """FLOPs of one query attending to one key over all layers: QK^T and PV, 2 each."""
        return 4 * self.num_layers * self.num_heads * self.head_dim

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelShape":
        try:
            return cls(**{name: int(data[name]) for name in cls.__dataclass_fields__})
        except KeyError as e:
            raise ValueError(f"model shape lacks field {e.args[0]!r}") from None

    @classmethod
    def from_model_config(cls, cfg: Any, dtype_bytes: int) -> "ModelShape":
        """Derive the shape from a model config by reading attributes only (HF-style names:
        `num_hidden_layers`, `num_attention_heads`, `num_key_value_heads`, `head_dim`,
        `hidden_size`, `intermediate_size`, `vocab_size`; MoE: `num_experts`,
        `num_experts_per_tok`, `moe_intermediate_size`, `num_shared_experts`). When the config
        has `num_active_params()` / `num_params()` methods (`ModelConfig`), those counts win."""
        if dtype_bytes < 1:
            raise ValueError("dtype_bytes must be positive")
        num_layers = int(_attr(cfg, "num_hidden_layers", "num_layers"))
        hidden = int(_attr(cfg, "hidden_size"))
        num_heads = int(_attr(cfg, "num_attention_heads", "num_heads"))
        num_kv_heads = int(_attr(cfg, "num_key_value_heads", "num_kv_heads", default=num_heads))
        head_dim = int(_attr(cfg, "head_dim", default=hidden // num_heads) or hidden // num_heads)
        attn = hidden * head_dim * (2 * num_heads + 2 * num_kv_heads)  # q, o + k, v
        dense_mlp = 3 * hidden * int(_attr(cfg, "intermediate_size", default=4 * hidden))
        num_experts = int(_attr(cfg, "num_experts", "num_local_experts", "n_routed_experts",
                                default=0) or 0)
        if num_experts:
            expert_mlp = 3 * hidden * int(_attr(cfg, "moe_intermediate_size",
                                                "intermediate_size"))
            top_k = int(_attr(cfg, "num_experts_per_tok", "top_k"))
            shared = int(_attr(cfg, "num_shared_experts", "n_shared_experts", default=0) or 0)
            active_mlp = (top_k + shared) * expert_mlp + hidden * num_experts  # + router
            total_mlp = (num_experts + shared) * expert_mlp + hidden * num_experts
        else:
            active_mlp = total_mlp = dense_mlp
        vocab = int(_attr(cfg, "vocab_size", default=0) or 0)
        tied = bool(_attr(cfg, "tie_word_embeddings", default=False))
        embed_params = vocab * hidden * (1 if tied else 2)
        active_params = num_layers * (attn + active_mlp)
        total_params = num_layers * (attn + total_mlp) + embed_params
        # Prefer the config's own counts (they know biases, norms, architecture quirks).
        if callable(getattr(cfg, "num_active_params", None)):
            active_params = int(cfg.num_active_params())
        if callable(getattr(cfg, "num_params", None)):
            total_params = int(cfg.num_params())
        return cls(
            num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim, hidden_size=hidden, active_params=active_params,
            kv_bytes_per_token=2 * num_layers * num_kv_heads * head_dim * dtype_bytes,
            weight_bytes=total_params * dtype_bytes,
        )


_MISSING = object()


def _attr(cfg: Any, *names: str, default: Any = _MISSING) -> Any:
    """First attribute of `cfg` among `names` that exists and is not None."""
    for name in names:
        value = getattr(cfg, name, None)
        if value is not None:
            return value
    if default is _MISSING:
        raise ValueError(f"model config has none of {names}")
    return default
