"""Large models described by their config, for the roofline step-time model. Pure.

`AnalyticModel` holds what a step costs per token on a cluster: parameters every token passes
through (FLOPs), weights a step reads (dense part always, routed experts only when touched),
KV bytes per token (MLA: the compressed latent), attention FLOPs per (query, key) pair for
prefill (MLA expanded to heads) and decode (MLA "absorbed": attention over the latent), and
the expert-parallel dispatch/combine bytes per routed token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deepinfer.core.model_shape import ModelShape


@dataclass(frozen=True)
class AnalyticModel:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    active_params: int  # per token, linear layers (incl. LM head)
    total_params: int
    dense_params: int  # everything but the routed experts (read by every step)
    kv_bytes_per_token: int
    prefill_attn_flops_per_pair: int  # all layers
    decode_attn_flops_per_pair: int  # all layers
    weight_bytes_per_param: float = 1.0  # fp8 weights
    compute_dtype: str = "fp8"
    num_experts: int = 0  # routed, per MoE layer
    num_experts_per_tok: int = 0
    num_moe_layers: int = 0
    expert_params: int = 0  # one routed expert in one layer
    dispatch_bytes_per_value: float = 1.0  # fp8 dispatch
    combine_bytes_per_value: float = 2.0  # bf16 combine
    max_nodes_per_token: int | None = None  # node-limited routing (DeepSeek-V3: 4)

    def __post_init__(self) -> None:
        if min(self.num_layers, self.hidden_size, self.num_heads, self.active_params,
               self.total_params, self.kv_bytes_per_token) < 1:
            raise ValueError(f"{self.name}: sizes must be positive")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"{self.name}: num_experts_per_tok must be in [1, num_experts]")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def expert_bytes_per_layer(self) -> float:
        return self.expert_params * self.weight_bytes_per_param

    @property
    def dense_weight_bytes(self) -> float:
        return self.dense_params * self.weight_bytes_per_param

    @property
    def ep_bytes_per_token_layer(self) -> float:
        """Bytes one token sends and gets back through the all-to-alls of one MoE layer."""
        return self.num_experts_per_tok * self.hidden_size * (
            self.dispatch_bytes_per_value + self.combine_bytes_per_value)

    def model_shape(self) -> ModelShape:
        """The core cost model's view (for compute-aware budgets and prefill routing)."""
        head_dim = max(1, self.prefill_attn_flops_per_pair // (4 * self.num_layers * self.num_heads))
        return ModelShape(
            num_layers=self.num_layers, num_heads=self.num_heads, num_kv_heads=self.num_heads,
            head_dim=head_dim, hidden_size=self.hidden_size, active_params=self.active_params,
            kv_bytes_per_token=self.kv_bytes_per_token,
            weight_bytes=int(self.total_params * self.weight_bytes_per_param),
            num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
            expert_bytes=int(self.expert_params * self.num_moe_layers * self.weight_bytes_per_param))


def mla_moe_model(name: str, cfg: dict[str, Any], kv_dtype_bytes: int = 2) -> AnalyticModel:
    """A DeepSeek-V2/V3-style model from its HF config keys (MLA attention, MoE FFN)."""
    try:
        hidden, layers, heads = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]
        q_lora, kv_lora = cfg.get("q_lora_rank"), cfg["kv_lora_rank"]
        nope, rope, v_dim = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
        num_dense = cfg.get("first_k_dense_replace", 0)
        dense_inter, moe_inter = cfg["intermediate_size"], cfg["moe_intermediate_size"]
        experts, top_k = cfg["n_routed_experts"], cfg["num_experts_per_tok"]
        shared, vocab = cfg.get("n_shared_experts", 0), cfg["vocab_size"]
    except KeyError as e:
        raise ValueError(f"{name}: config lacks {e.args[0]!r}") from None
    qk = nope + rope
    q_proj = hidden * q_lora + q_lora * heads * qk if q_lora else hidden * heads * qk
    attn = q_proj + hidden * (kv_lora + rope) + kv_lora * heads * (nope + v_dim) + heads * v_dim * hidden
    expert = 3 * hidden * moe_inter
    num_moe = layers - num_dense
    dense_mlp = 3 * hidden * dense_inter
    router = hidden * experts
    embed = vocab * hidden
    total = (layers * attn + num_dense * dense_mlp + num_moe * ((experts + shared) * expert + router)
             + 2 * embed)
    active = layers * attn + num_dense * dense_mlp + num_moe * ((top_k + shared) * expert + router) + embed
    return AnalyticModel(
        name=name, num_layers=layers, hidden_size=hidden, num_heads=heads,
        active_params=active, total_params=total, dense_params=total - num_moe * experts * expert,
        kv_bytes_per_token=layers * (kv_lora + rope) * kv_dtype_bytes,
        # prefill: heads expanded, QK^T over qk dims + PV over v dims, 2 FLOPs per MAC
        prefill_attn_flops_per_pair=layers * 2 * heads * (qk + v_dim),
        # decode: weights absorbed, QK^T over the latent + rope, PV over the latent
        decode_attn_flops_per_pair=layers * 2 * heads * (kv_lora + rope + kv_lora),
        num_experts=experts, num_experts_per_tok=top_k, num_moe_layers=num_moe,
        expert_params=expert, max_nodes_per_token=cfg.get("topk_group"))


DEEPSEEK_V3_CONFIG = {  # config.json of deepseek-ai/DeepSeek-V3 (MTP module left out)
    "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "first_k_dense_replace": 3, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "n_routed_experts": 256, "num_experts_per_tok": 8,
    "n_shared_experts": 1, "vocab_size": 129280, "n_group": 8, "topk_group": 4,
}

MODELS = {"deepseek-v3": lambda: mla_moe_model("deepseek-v3", DEEPSEEK_V3_CONFIG)}


def analytic_model(name: str) -> AnalyticModel:
    factory = MODELS.get(name.lower())
    if factory is None:
        raise ValueError(f"unknown analytic model {name!r}; choose one of {sorted(MODELS)}")
    return factory()
