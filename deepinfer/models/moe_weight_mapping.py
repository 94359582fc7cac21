"""Checkpoint names of MoE models -> our stacked expert and fused shared-expert parameters.

    experts.{e}.gate_proj.weight [I, H]  ->  experts.gate_up_proj[e, 0:I]
    experts.{e}.up_proj.weight   [I, H]  ->  experts.gate_up_proj[e, I:2I]
    experts.{e}.down_proj.weight [H, I]  ->  experts.down_proj[e]
    experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]   (fused 3-D: same names)
    shared_experts.gate_proj / up_proj   ->  shared_experts.gate_up_proj rows [gate | up]

Mixtral's names (`block_sparse_moe`, `w1`/`w3`/`w2`) are first rewritten to these.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from deepinfer.models.model_config import ModelConfig

_EXPERT = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_MIXTRAL_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_MIXTRAL_EXPERT = re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class ExpertShardTarget:
    """Rows [row_offset, row_offset + num_rows) of `param_name`[expert_id] (all experts when
    expert_id is None; all rows when num_rows is None)."""

    param_name: str
    expert_id: int | None
    row_offset: int
    num_rows: int | None


def normalize_moe_name(name: str) -> str:
    """Mixtral's checkpoint names -> the HF MoE names the rest of the mapping uses."""
    if ".block_sparse_moe." not in name:
        return name
    name = _MIXTRAL_EXPERT.sub(lambda m: f".mlp.experts.{m.group(1)}.{_MIXTRAL_PROJ[m.group(2)]}.", name)
    return name.replace(".block_sparse_moe.", ".mlp.")


def is_extra_layer(name: str, config: ModelConfig) -> bool:
    """DeepSeek-V3 checkpoints append multi-token-prediction layers after the last decoder
    layer (model.layers.61.* for 61 layers); the causal LM does not use them."""
    match = _LAYER.match(name)
    return (config.architecture in ("deepseek_v2", "deepseek_v3") and match is not None
            and int(match.group(1)) >= config.num_hidden_layers)


def expert_shard_target(name: str, config: ModelConfig) -> ExpertShardTarget | None:
    """Where an expert / shared-expert tensor goes, or None for other names."""
    moe = config.moe
    if moe is None:
        return None
    match = _EXPERT.match(name)
    if match:
        inter = moe.moe_intermediate_size
        expert = int(match.group("expert"))
        if expert >= moe.num_experts:
            raise ValueError(f"checkpoint tensor {name!r}: expert {expert} >= num_experts {moe.num_experts}")
        proj = match.group("proj")
        if proj == "down_proj":
            return ExpertShardTarget(f"{match.group('prefix')}.down_proj", expert, 0, None)
        offset = 0 if proj == "gate_proj" else inter
        return ExpertShardTarget(f"{match.group('prefix')}.gate_up_proj", expert, offset, inter)
    for part, offset in ((".shared_experts.gate_proj.", 0), (".shared_experts.up_proj.", 1)):
        if part in name:
            inter = moe.shared_intermediate_size
            return ExpertShardTarget(name.replace(part, ".shared_experts.gate_up_proj."), None,
                                     offset * inter, inter)
    return None
