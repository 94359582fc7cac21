"""Parallel serving settings (`--data-parallel-size`, `--enable-expert-parallel`, EPLB): plain
data, validated on construction, no IO."""
from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.moe.dispatch import DISPATCHERS
from deepinfer.moe.eplb_config import EPLBConfig


@dataclass(frozen=True)
class EPConfig:
    data_parallel_size: int = 1  # ranks per group, each with its own scheduler and KV cache
    enable_expert_parallel: bool = False  # MoE layers sharded over the group's ranks
    num_groups: int = 1  # independent groups the front routes over (a dead rank takes out one)
    dispatcher: str = "alltoall"  # token dispatch/combine: alltoall | allgather_reducescatter
    enable_eplb: bool = False
    eplb: EPLBConfig = field(default_factory=EPLBConfig)
    collective_timeout_s: float = 60.0  # a collective waiting longer fails its rank (no hang)
    backend: str | None = None  # torch.distributed backend; None: nccl on CUDA, gloo on CPU

    def __post_init__(self) -> None:
        if self.data_parallel_size < 1:
            raise ValueError("--data-parallel-size must be >= 1")
        if self.num_groups < 1:
            raise ValueError("--ep-groups must be >= 1")
        if self.dispatcher not in DISPATCHERS:
            raise ValueError(f"--all2all-backend must be one of {sorted(DISPATCHERS)}")
        if self.enable_eplb and not self.enable_expert_parallel:
            raise ValueError("--enable-eplb needs --enable-expert-parallel")
        if self.collective_timeout_s <= 0:
            raise ValueError("--ep-collective-timeout must be positive")
        if self.backend not in (None, "gloo", "nccl"):
            raise ValueError("backend must be gloo or nccl")

    @property
    def is_parallel(self) -> bool:
        """More than one engine process (else plain colocated serving)."""
        return self.data_parallel_size * self.num_groups > 1 or self.enable_expert_parallel

    @property
    def num_redundant_experts(self) -> int:
        return self.eplb.num_redundant_experts if self.enable_eplb else 0

    def check_model(self, model_config) -> None:
        """ValueError if the model cannot run with these settings (before any process starts)."""
        if not self.enable_expert_parallel:
            return
        moe = getattr(model_config, "moe", None)
        if moe is None:
            raise ValueError("--enable-expert-parallel needs a MoE model "
                             f"({model_config.architecture} has no experts)")
        slots = moe.num_experts + self.num_redundant_experts
        if slots % self.data_parallel_size:
            raise ValueError(f"{moe.num_experts} experts + {self.num_redundant_experts} redundant "
                             f"do not divide over {self.data_parallel_size} ranks")

    def redundant_expert_bytes(self, model_config, dtype: str) -> int:
        """Bytes a group spends on redundant expert slots (all MoE layers, all ranks)."""
        moe = getattr(model_config, "moe", None)
        if moe is None or not self.enable_expert_parallel:
            return 0
        element = {"float32": 4}.get(dtype, 2)
        per_expert = 3 * model_config.hidden_size * moe.moe_intermediate_size * element
        num_layers = sum(moe.is_moe_layer(i) for i in range(model_config.num_hidden_layers))
        return self.num_redundant_experts * per_expert * num_layers
