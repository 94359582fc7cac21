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
    `kv_bytes_per_token`: K and V bytes of one token over all layers (MLA: the latent entry).
    `weight_bytes`: bytes of all weights. A dense step reads them all once; an MoE step reads
    the dense part plus only the routed experts its tokens touch (`weight_bytes_read`).
    MoE (all 0 for dense models): `num_experts` routed experts per MoE layer, `num_experts_per_tok`
    chosen per token, `expert_bytes` = bytes of one routed expert summed over the MoE layers.
    """

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    active_params: int
    kv_bytes_per_token: int
    weight_bytes: int
    num_experts: int = 0
    num_experts_per_tok: int = 0
    expert_bytes: int = 0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if value < 0 or (value == 0 and name not in _MAY_BE_ZERO):
                raise ValueError(f"ModelShape.{name} must be positive, got {value}")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError("ModelShape.num_experts_per_tok must be in [1, num_experts]")
        if self.num_experts * self.expert_bytes > self.weight_bytes:
            raise ValueError("ModelShape: routed experts cannot outweigh all weights")

    @property
    def dense_weight_bytes(self) -> int:
        """Weights every step reads whatever its tokens: all but the routed experts."""
        return self.weight_bytes - self.num_experts * self.expert_bytes

    def expected_distinct_experts(self, num_tokens: float) -> float:
        """Expected routed experts (per MoE layer) that `num_tokens` tokens touch, each token
        choosing num_experts_per_tok of num_experts uniformly: E·(1 − (1 − k/E)^n)."""
        if not self.num_experts or num_tokens <= 0:
            return 0.0
        miss = 1.0 - self.num_experts_per_tok / self.num_experts
        return self.num_experts * (1.0 - miss ** num_tokens)

    def weight_bytes_read(self, num_tokens: float) -> float:
        """Weight bytes a step over `num_tokens` tokens reads (= weight_bytes for dense models)."""
        if not self.num_experts:
            return float(self.weight_bytes)
        return self.dense_weight_bytes + self.expert_bytes * self.expected_distinct_experts(num_tokens)

    @property
    def attention_flops_per_pair(self) -> int:
        """FLOPs of one query attending to one key over all layers: QK^T and PV, 2 each."""
        return 4 * self.num_layers * self.num_heads * self.head_dim

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelShape":
        try:
            return cls(**{name: int(data[name]) for name in cls.__dataclass_fields__
                          if name in data or name not in _MAY_BE_ZERO})
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
            expert_bytes = num_layers * expert_mlp * dtype_bytes  # every layer MoE
        else:
            active_mlp = total_mlp = dense_mlp
            top_k = expert_bytes = 0
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
        kv_bytes = 2 * num_layers * num_kv_heads * head_dim * dtype_bytes
        if callable(getattr(cfg, "kv_bytes_per_token", None)):  # knows MLA's latent entry
            kv_bytes = int(cfg.kv_bytes_per_token(dtype_bytes))
        moe = getattr(cfg, "moe", None)
        if moe is not None and callable(getattr(cfg, "num_expert_params", None)):
            num_experts, top_k = int(moe.num_experts), int(moe.num_experts_per_tok)
            expert_bytes = int(cfg.num_expert_params()) * dtype_bytes
        return cls(
            num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim, hidden_size=hidden, active_params=active_params,
            kv_bytes_per_token=kv_bytes, weight_bytes=total_params * dtype_bytes,
            num_experts=num_experts, num_experts_per_tok=top_k, expert_bytes=expert_bytes,
        )


_MISSING = object()
# Fields that are 0 for dense models (and absent from profiles written before MoE support).
_MAY_BE_ZERO = ("weight_bytes", "num_experts", "num_experts_per_tok", "expert_bytes")


def _attr(cfg: Any, *names: str, default: Any = _MISSING) -> Any:
    """First attribute of `cfg` among `names` that exists and is not None."""
    for name in names:
        value = getattr(cfg, name, None)
        if value is not None:
            return value
    if default is _MISSING:
        raise ValueError(f"model config has none of {names}")
    return default
