"""Hugging Face parameter names -> our (fused) parameters.

Every checkpoint format (safetensors, GGUF) is first translated to HF names by its loader;
this module is the one place that knows how HF names land in fused tensors.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

# Checkpoint entries that carry no parameters of ours (old HF Llama checkpoints store inv_freq).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class ShardTarget:
    """Where one checkpoint tensor goes: rows [row_offset, row_offset + num_rows) of `param_name`."""

    param_name: str
    row_offset: int
    num_rows: int


def fused_shard_target(name: str, q_size: int, kv_size: int, intermediate_size: int) -> ShardTarget | None:
    """Target rows for a q/k/v or gate/up tensor name, or None if `name` is not fused."""
    table = (
        (".self_attn.q_proj.", ".self_attn.qkv_proj.", 0, q_size),
        (".self_attn.k_proj.", ".self_attn.qkv_proj.", q_size, kv_size),
        (".self_attn.v_proj.", ".self_attn.qkv_proj.", q_size + kv_size, kv_size),
        (".mlp.gate_proj.", ".mlp.gate_up_proj.", 0, intermediate_size),
        (".mlp.up_proj.", ".mlp.gate_up_proj.", intermediate_size, intermediate_size),
    )
    for part, fused, offset, rows in table:
        if part in name:
            return ShardTarget(name.replace(part, fused), offset, rows)
    return None


def _destination(name: str, config, params: dict[str, nn.Parameter]) -> tuple[str, Tensor]:
    """(our parameter name, the view of it that checkpoint tensor `name` fills)."""
    from deepinfer.models.moe_weight_mapping import expert_shard_target

    expert = expert_shard_target(name, config)
    if expert is not None:
        param = params.get(expert.param_name)
        if param is None:
            raise ValueError(f"unexpected checkpoint tensor {name!r} for {config.architecture} model")
        dest = param.data if expert.expert_id is None else param.data[expert.expert_id]
        if expert.num_rows is not None:
            dest = dest.narrow(0, expert.row_offset, expert.num_rows)
        return expert.param_name, dest
    # MLA attention keeps HF's unfused projections; only the MLP halves are fused.
    target = fused_shard_target(name, config.q_size, config.kv_size, config.intermediate_size)
    if target is not None and config.mla is not None and ".self_attn." in name:
        target = None
    param_name = target.param_name if target else name
    param = params.get(param_name)
    if param is None:
        raise ValueError(f"unexpected checkpoint tensor {name!r} for {config.architecture} model")
    dest = param.data if target is None else param.data.narrow(0, target.row_offset, target.num_rows)
    return param_name, dest


def load_hf_named_weights(model: nn.Module, weights: Iterable[tuple[str, Tensor]],
                          skip_prefixes: tuple[str, ...] = ()) -> None:
    """Fill `model` from HF-named tensors; see LlamaForCausalLM.load_weights. Parameters
    named with `skip_prefixes` are the caller's to fill (e.g. a LLaVA vision tower)."""
    from deepinfer.models.moe_weight_mapping import is_extra_layer, normalize_moe_name

    config = model.config
    params = {n: p for n, p in model.named_parameters() if not n.startswith(skip_prefixes)}
    filled = {name: 0 for name in params}  # elements written, to find gaps
    seen: set[str] = set()
    for name, tensor in weights:
        if name.endswith(_IGNORED_SUFFIXES) or is_extra_layer(name, config):
            continue
        name = normalize_moe_name(name)
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # tied: logits reuse embed_tokens.weight
        if name in seen:
            raise ValueError(f"checkpoint tensor {name!r} appears twice")
        seen.add(name)
        param_name, dest = _destination(name, config, params)
        if tuple(tensor.shape) != tuple(dest.shape):
            raise ValueError(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
            )
        with torch.no_grad():
            dest.copy_(tensor)  # casts to the parameter dtype
        filled[param_name] += dest.numel()
    missing = [n for n, p in params.items() if filled[n] != p.numel()]
    if missing:
        shown = ", ".join(missing[:5]) + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
        raise ValueError(f"checkpoint is missing weights for: {shown}")
