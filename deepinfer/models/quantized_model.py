"""Put quantized checkpoint weights into a model: each `QuantizedWeight` a loader yields
replaces the `nn.Linear` (or the token `nn.Embedding`) it belongs to, fused projections
assembled from their parts, and every plain tensor goes to `load_weights` as before.

    q_proj | k_proj | v_proj  ->  self_attn.qkv_proj   (one weight when the parts share a
    gate_proj | up_proj       ->  mlp.gate_up_proj      format: rows concatenated; else parts)

A tied LM head over a quantized embedding table computes with the same `QuantizedWeight`
(`model.logits_linear`), never a copy. `quantize_linears_int8` is the load-time int8 path for
bf16 / float32 checkpoints (`--quantization int8`).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from deepinfer.models.weight_mapping import fused_shard_target
from deepinfer.quant.quantized_linear import QuantizedEmbedding, QuantizedLinear
from deepinfer.quant.quantized_weight import QuantizedWeight, quantize_int8

EMBED_NAME = "model.embed_tokens.weight"


@dataclass
class _FusedParts:
    num_rows: int
    parts: dict[int, QuantizedWeight]  # row offset -> part
    names: dict[int, str]  # row offset -> checkpoint name


def _module_path(param_name: str) -> str:
    if not param_name.endswith(".weight"):
        raise ValueError(f"a quantized tensor must be a weight, got {param_name!r}")
    return param_name[: -len(".weight")]


def _assemble(path: str, fused: _FusedParts) -> list[QuantizedWeight]:
    offsets = sorted(fused.parts)
    at = 0
    for offset in offsets:
        if offset != at:
            raise ValueError(f"checkpoint is missing rows [{at}, {offset}) of {path}")
        at += fused.parts[offset].out_features
    if at != fused.num_rows:
        raise ValueError(f"checkpoint is missing rows [{at}, {fused.num_rows}) of {path}")
    parts = [fused.parts[o] for o in offsets]
    if len({p.format for p in parts}) == 1 and len(parts) > 1:
        first = parts[0]
        return [QuantizedWeight(first.format, fused.num_rows, first.in_features,
                                torch.cat([p.data for p in parts]), None, first.block)]
    return parts


def _replace(model: nn.Module, path: str, module: nn.Module) -> nn.Module:
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    old = getattr(parent, name, None)
    if not isinstance(old, (nn.Linear, nn.Embedding)):
        raise ValueError(f"checkpoint has a quantized tensor for {path!r}, which is not a linear layer")
    setattr(parent, name, module)
    return old


def _linear_for(old: nn.Linear, parts: list[QuantizedWeight]) -> QuantizedLinear:
    rows = sum(p.out_features for p in parts)
    if (rows, parts[0].in_features) != (old.out_features, old.in_features):
        raise ValueError(f"quantized weight shape [{rows}, {parts[0].in_features}] does not match "
                         f"the layer's [{old.out_features}, {old.in_features}]")
    bias = None if old.bias is None else torch.empty_like(old.bias)  # filled by load_weights
    return QuantizedLinear(parts, bias)


def load_quantized_weights(model: nn.Module, weights: Iterable[tuple[str, Tensor | QuantizedWeight]]) -> None:
    """Fill `model` (LlamaForCausalLM-like: `config`, `load_weights`) from HF-named tensors
    and `QuantizedWeight`s. Raises ValueError on unknown names, wrong shapes or gaps."""
    config = model.config
    plain: list[tuple[str, Tensor]] = []
    whole: dict[str, QuantizedWeight] = {}
    fused: dict[str, _FusedParts] = {}
    for name, value in weights:
        if not isinstance(value, QuantizedWeight):
            plain.append((name, value))
            continue
        target = fused_shard_target(name, config.q_size, config.kv_size, config.intermediate_size)
        if target is None:
            if name in whole:
                raise ValueError(f"checkpoint tensor {name!r} appears twice")
            whole[name] = value
            continue
        group = fused.setdefault(target.param_name, _FusedParts(0, {}, {}))
        if target.row_offset in group.parts or value.out_features != target.num_rows:
            raise ValueError(f"checkpoint tensor {name!r}: duplicate or wrong shape "
                             f"({value.out_features} rows, expected {target.num_rows})")
        group.parts[target.row_offset] = value
        group.names[target.row_offset] = name
    # A fused layer whose parts mix plain and quantized tensors (a Q4_K_M file keeps q/k in
    # F32) cannot be one quantized kernel: its quantized parts are expanded and it stays plain.
    plain_targets = {t.param_name for t in (
        fused_shard_target(n, config.q_size, config.kv_size, config.intermediate_size)
        for n, _ in plain) if t is not None}
    for param_name in plain_targets & fused.keys():
        group = fused.pop(param_name)
        plain.extend((group.names[o], w.dequantize(model.dtype)) for o, w in group.parts.items())
    for param_name, group in fused.items():
        path = _module_path(param_name)
        old = model.get_submodule(path)
        group.num_rows = old.out_features
        _replace(model, path, _linear_for(old, _assemble(path, group)))
    embed = whole.pop(EMBED_NAME, None)
    head = whole.pop("lm_head.weight", None)
    if head is not None and config.tie_word_embeddings:
        head = None  # tied: logits reuse the embedding table
    for name, weight in whole.items():
        path = _module_path(name)
        _replace(model, path, _linear_for(model.get_submodule(path), [weight]))
    if head is not None:
        model.lm_head = _linear_for(model.lm_head, [head])
        model._plain_lm_head = (None,)
    if embed is not None:
        table = model.model.embed_tokens
        if (embed.out_features, embed.in_features) != (table.num_embeddings, table.embedding_dim):
            raise ValueError(f"quantized embedding shape {list(embed.shape)} does not match the model")
        model.model.embed_tokens = QuantizedEmbedding(embed, model.dtype)
        if config.tie_word_embeddings:
            model.logits_linear = QuantizedLinear(embed)
    model.load_weights(plain)


def quantized_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, (QuantizedLinear, QuantizedEmbedding))]


def quantize_linears_int8(model: nn.Module) -> int:
    """Replace the decoder layers' nn.Linear weights with int8 per-channel ones (the embedding
    and the LM head stay as they are); returns how many layers."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError("int8 quantization needs a decoder with `model.layers`")
    targets = [(parent, name, child) for parent in layers.modules()
               for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    for parent, name, child in targets:
        bias = None if child.bias is None else child.bias.detach()
        setattr(parent, name, QuantizedLinear(quantize_int8(child.weight), bias))
    return len(targets)


def weight_bytes_by_format(model: nn.Module) -> dict[str, int]:
    """Resident bytes of the model's weights by format: quantized formats by name (their
    scales as "<format> scales"), everything else by dtype -- parameters, buffers, and the
    tensors modules keep beside them (a packed layer's plain copy for its small-batch kernel).
    Each tensor's own bytes, counted once: weights may share one huge-page arena, and a
    oneDNN-packed tensor has no storage to ask. Rotary tables are derived, not weights."""
    from deepinfer.layers.rotary import RotaryEmbedding

    seen: set[tuple[int, int]] = set()
    totals: dict[str, int] = {}

    def add(key: str, tensor: Tensor | None) -> None:
        if tensor is None or tensor.numel() == 0:
            return
        nbytes = tensor.numel() * tensor.element_size()
        try:
            ident = (tensor.data_ptr(), nbytes)
        except RuntimeError:  # an opaque (oneDNN-packed) tensor
            ident = (id(tensor), nbytes)
        if ident not in seen:
            seen.add(ident)
            totals[key] = totals.get(key, 0) + nbytes

    for module in quantized_modules(model):
        for part in module.parts:
            add(part.format, part.data)
            add(f"{part.format} scales", part.scale)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            continue
        for value in [*module._parameters.values(), *module._buffers.values(),
                      *vars(module).values()]:
            if isinstance(value, Tensor):
                add(str(value.dtype).removeprefix("torch."), value)
    return totals
