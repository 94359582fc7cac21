"""Mixture-of-experts hyper-parameters. Pure: stdlib only.

Parsed from a Hugging Face `config.json` dict for Mixtral, Qwen3-MoE and DeepSeek-V2/V3. Values
this engine does not implement (an unknown `scoring_func`, `topk_method`, activation, ...)
raise ValueError at load time: a model must never run with silently different routing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SCORING_FUNCS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoEConfig:
    """How one MoE layer routes and which layers are MoE.

    Routing (see `deepinfer.moe.routing.select_experts`):
      scores = softmax(logits) or sigmoid(logits)
      selection uses scores (+ `e_score_correction_bias` when `use_correction_bias`), first
      restricted to the best `topk_group` of `n_group` expert groups when `n_group > 1`;
      weights are the *unbiased* scores of the chosen experts, renormalised to sum 1 when
      `norm_topk_prob`, then multiplied by `routed_scaling_factor`.
    """

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    scoring_func: str = "softmax"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    use_correction_bias: bool = False
    num_shared_experts: int = 0
    # Layer indices whose MLP is dense (config.intermediate_size) instead of MoE.
    dense_layers: frozenset[int] = frozenset()
    # DeepSeek computes the router in fp32 (HF keeps gate.weight in fp32).
    router_fp32: bool = False

    def __post_init__(self) -> None:
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"unsupported MoE scoring_func {self.scoring_func!r}; "
                             f"supported: {', '.join(SCORING_FUNCS)}")
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be in "
                             f"[1, num_experts={self.num_experts}]")
        if self.n_group < 1 or self.num_experts % self.n_group:
            raise ValueError(f"n_group ({self.n_group}) must divide num_experts ({self.num_experts})")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group ({self.topk_group}) must be in [1, n_group={self.n_group}]")
        if self.n_group > 1 and self.topk_group * (self.num_experts // self.n_group) < self.num_experts_per_tok:
            raise ValueError("topk_group groups hold fewer experts than num_experts_per_tok")
        if self.moe_intermediate_size <= 0:
            raise ValueError(f"moe_intermediate_size must be positive, got {self.moe_intermediate_size}")

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx not in self.dense_layers

    @property
    def shared_intermediate_size(self) -> int:
        """Width of the shared-expert MLP (DeepSeek fuses its shared experts into one)."""
        return self.num_shared_experts * self.moe_intermediate_size


def _require_silu(cfg: dict[str, Any]) -> None:
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r} (supported: silu)")


def moe_config_from_hf(arch: str, cfg: dict[str, Any]) -> MoEConfig | None:
    """The MoE part of an HF config for `arch`, or None for dense architectures."""
    if arch == "mixtral":
        _require_silu(cfg)
        return MoEConfig(
            num_experts=int(cfg["num_local_experts"]),
            num_experts_per_tok=int(cfg["num_experts_per_tok"]),
            moe_intermediate_size=int(cfg["intermediate_size"]),
            norm_topk_prob=True)
    if arch == "qwen3_moe":
        _require_silu(cfg)
        num_layers = int(cfg["num_hidden_layers"])
        step = int(cfg.get("decoder_sparse_step", 1) or 1)
        mlp_only = {int(i) for i in cfg.get("mlp_only_layers") or ()}
        num_experts = int(cfg.get("num_experts", cfg.get("num_local_experts", 0)) or 0)
        dense = frozenset(i for i in range(num_layers)
                          if i in mlp_only or num_experts == 0 or (i + 1) % step != 0)
        return MoEConfig(
            num_experts=num_experts,
            num_experts_per_tok=int(cfg["num_experts_per_tok"]),
            moe_intermediate_size=int(cfg["moe_intermediate_size"]),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            dense_layers=dense)
    if arch == "deepseek_v2":
        return _deepseek_v2_moe(cfg)
    if arch == "deepseek_v3":
        _require_silu(cfg)
        _require_choice(cfg, "scoring_func", "sigmoid", ("sigmoid",), "DeepSeek-V3")
        _require_choice(cfg, "topk_method", "noaux_tc", ("noaux_tc",), "DeepSeek-V3")
        return MoEConfig(
            num_experts=int(cfg["n_routed_experts"]),
            num_experts_per_tok=int(cfg["num_experts_per_tok"]),
            moe_intermediate_size=int(cfg["moe_intermediate_size"]),
            scoring_func="sigmoid",
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            n_group=int(cfg.get("n_group") or 1),
            topk_group=int(cfg.get("topk_group") or 1),
            use_correction_bias=True,
            num_shared_experts=int(cfg.get("n_shared_experts") or 0),
            dense_layers=_deepseek_dense_layers(cfg),
            router_fp32=True)
    return None


def _deepseek_v2_moe(cfg: dict[str, Any]) -> MoEConfig:
    """DeepSeek-V2: softmax scores, greedy or group-limited greedy (a group scored by its best
    expert), no selection bias; renormalised only when norm_topk_prob (false in V2 releases)."""
    _require_silu(cfg)
    _require_choice(cfg, "scoring_func", "softmax", ("softmax",), "DeepSeek-V2")
    method = _require_choice(cfg, "topk_method", "greedy", ("greedy", "group_limited_greedy"), "DeepSeek-V2")
    grouped = method == "group_limited_greedy"
    return MoEConfig(
        num_experts=int(cfg["n_routed_experts"]),
        num_experts_per_tok=int(cfg["num_experts_per_tok"]),
        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        n_group=int(cfg.get("n_group") or 1) if grouped else 1,
        topk_group=int(cfg.get("topk_group") or 1) if grouped else 1,
        num_shared_experts=int(cfg.get("n_shared_experts") or 0),
        dense_layers=_deepseek_dense_layers(cfg),
        router_fp32=True)


def _require_choice(cfg: dict[str, Any], key: str, default: str, supported: tuple[str, ...],
                    family: str) -> str:
    value = cfg.get(key, default)
    if value not in supported:
        raise ValueError(f"unsupported {key} {value!r} for {family} (supported: {', '.join(supported)})")
    return value


def _deepseek_dense_layers(cfg: dict[str, Any]) -> frozenset[int]:
    """DeepSeek V2/V3: the first `first_k_dense_replace` layers are dense, every later one MoE."""
    num_layers = int(cfg["num_hidden_layers"])
    first_dense = int(cfg.get("first_k_dense_replace", 0) or 0)
    freq = int(cfg.get("moe_layer_freq", 1) or 1)
    if freq != 1:
        raise ValueError(f"unsupported moe_layer_freq {freq} (supported: 1)")
    return frozenset(range(min(first_dense, num_layers)))
