"""Load a block-scaled FP8 checkpoint (DeepSeek-V3/R1, Qwen3-FP8) keeping its weights in FP8.

    checkpoint tensor                          dtype         becomes
    <linear>.weight                            F8_E4M3       QuantizedWeight data (1 byte each)
    <linear>.weight_scale_inv                  F32           its scale [ceil(out/bo), ceil(in/bi)]
    experts.gate_up_proj / down_proj (3-D)     F8_E4M3       one weight per expert [e]
    experts.gate_up_proj_scale_inv (3-D)       F32           ... and its scale [e]
    everything else (embeddings, norms, routers, LM head, biases)   loaded as usual

Two passes over the safetensors shards: first the FP8 weights and their scales, which replace
the model's linear modules (`QuantizedLinear`, fused parts stacked when their blocks line up,
`QuantizedMoEExperts` for routed experts); then every other tensor through the usual name
mapping into what is left. Which modules are FP8 follows the tensors' own dtypes; a module
that `modules_to_not_convert` lists yet is stored in FP8, or an FP8 weight without its scale
(or a scale without its weight), is a load error. MLA's `kv_b_proj` is dequantized into its
dense [H * (nope + v), r] weight: the absorbed attention folds it per head (mla.py), so it is
read as a tensor, never through a linear kernel.
"""
from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from safetensors import safe_open
from torch import Tensor, nn

from deepinfer.models.moe_weight_mapping import (expert_shard_target, is_extra_layer,
                                                 normalize_moe_name)
from deepinfer.models.weight_mapping import fused_shard_target, load_hf_named_weights
from deepinfer.quant.fused_quantized import QuantizedMoEExperts, fused_quantized_linear
from deepinfer.quant.quant_config import Fp8BlockQuantConfig
from deepinfer.quant.quantized_linear import QuantizedLinear
from deepinfer.quant.quantized_weight import FP8_BLOCK, QuantizedWeight

logger = logging.getLogger(__name__)

SCALE_SUFFIX = "_scale_inv"  # <weight name> + this: its scales
_FP8_DTYPES = {"F8_E4M3"}


def read_fp8_tensors(files: list[str], config) -> dict[str, QuantizedWeight | Tensor]:
    """HF name (normalized) -> the weight (2-D: a QuantizedWeight; 3-D fused experts: the raw
    [E, out, in] fp8 tensor, with its scales under name + SCALE_SUFFIX)."""
    values: dict[str, Tensor] = {}
    scales: dict[str, Tensor] = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if is_extra_layer(name, config):
                    continue  # DeepSeek's MTP layers: not part of the causal LM
                dtype = f.get_slice(name).get_dtype()
                if name.endswith(SCALE_SUFFIX):
                    scales[normalize_moe_name(name[:-len(SCALE_SUFFIX)])] = f.get_tensor(name)
                elif dtype in _FP8_DTYPES:
                    values[normalize_moe_name(name)] = f.get_tensor(name)
                elif dtype.startswith("F8"):
                    raise ValueError(f"checkpoint tensor {name!r} is {dtype}: only float8_e4m3fn "
                                     "weights are supported")
                elif name.endswith((".input_scale", ".weight_scale")):
                    raise ValueError(f"checkpoint tensor {name!r}: per-tensor / static FP8 "
                                     "scales are not supported (block-scaled weights only)")
    unpaired = sorted(set(values) ^ set(scales))
    if unpaired:
        name = unpaired[0]
        what = "has no scale tensor" if name in values else "is a scale without its weight"
        raise ValueError(f"FP8 checkpoint tensor {name!r} {what} ({name}{SCALE_SUFFIX})")
    return {name: values[name] for name in values} | {
        name + SCALE_SUFFIX: scales[name] for name in scales}


def plain_tensors(files: list[str], skip: set[str]) -> Iterator[tuple[str, Tensor]]:
    """Every tensor of the shards whose (normalized) name is not in `skip`."""
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if normalize_moe_name(name) not in skip and not (
                        name.endswith(SCALE_SUFFIX)
                        and normalize_moe_name(name[:-len(SCALE_SUFFIX)]) in skip):
                    yield name, f.get_tensor(name)


@dataclass
class _Plan:
    """FP8 weights grouped by the module of ours they become."""

    fused: dict[str, list[tuple[int, QuantizedWeight]]] = field(default_factory=lambda: defaultdict(list))
    single: dict[str, QuantizedWeight] = field(default_factory=dict)
    # experts module path -> expert id -> {"gate_proj" | "up_proj" | "down_proj" | "gate_up_proj": weight}
    experts: dict[str, dict[int, dict[str, QuantizedWeight]]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(dict)))


def _weight(data: Tensor, scale: Tensor, block: tuple[int, int], name: str,
            device: torch.device) -> QuantizedWeight:
    try:
        return QuantizedWeight(FP8_BLOCK, data.shape[0], data.shape[1],
                               data.to(device).contiguous(),
                               scale.to(device, torch.float32).contiguous(), tuple(block))
    except ValueError as e:
        raise ValueError(f"FP8 checkpoint tensor {name!r}: {e}") from None


def plan_modules(tensors: dict[str, Tensor], config, quant: Fp8BlockQuantConfig,
                 device: torch.device) -> _Plan:
    plan = _Plan()
    block = quant.weight_block_size
    for name, data in tensors.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        scale = tensors[name + SCALE_SUFFIX]
        module = name[:-len(".weight")] if name.endswith(".weight") else name
        if quant.skips(module):
            raise ValueError(f"quantization_config lists {module!r} in modules_to_not_convert, "
                             f"but the checkpoint stores {name!r} in FP8")
        if data.dim() == 3:  # fused experts [E, out, in]: one weight per expert
            prefix, _, proj = module.rpartition(".")
            if not prefix.endswith(".experts") or proj not in ("gate_up_proj", "down_proj"):
                raise ValueError(f"unexpected 3-D FP8 checkpoint tensor {name!r}")
            for e in range(data.shape[0]):
                plan.experts[prefix][e][proj] = _weight(data[e], scale[e], block, name, device)
            continue
        weight = _weight(data, scale, block, name, device)
        expert = expert_shard_target(name, config)
        if expert is not None and expert.expert_id is not None:
            prefix, _, _ = expert.param_name.rpartition(".")
            proj = name.rsplit(".", 2)[-2]  # gate_proj | up_proj | down_proj
            plan.experts[prefix][expert.expert_id][proj] = weight
            continue
        target = fused_shard_target(name, config.q_size, config.kv_size, config.intermediate_size)
        if expert is not None:  # a shared expert's gate / up half
            plan.fused[expert.param_name].append((expert.row_offset, weight))
        elif target is not None and not (config.mla is not None and ".self_attn." in name):
            plan.fused[target.param_name].append((target.row_offset, weight))
        else:
            plan.single[module] = weight
    return plan


def _replace(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, child = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def _bias_like(linear: nn.Module) -> Tensor | None:
    bias = getattr(linear, "bias", None)
    return None if bias is None else torch.empty_like(bias.data)  # filled by the second pass


def _existing(model: nn.Module, path: str, name: str) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError:
        raise ValueError(f"unexpected FP8 checkpoint tensor {name!r} for "
                         f"{model.config.architecture} model") from None


def _install_linears(model: nn.Module, plan: _Plan) -> list[tuple[str, Tensor]]:
    """Replace the planned linear modules; returns the dequantized (name, tensor) of bare
    projection weights (MLA kv_b_proj) for the second pass."""
    dense: list[tuple[str, Tensor]] = []
    for param_name, parts in plan.fused.items():
        path = param_name[:-len(".weight")]
        linear = _existing(model, path, param_name)
        parts.sort(key=lambda p: p[0])
        offsets = [offset for offset, _ in parts]
        rows = [w.out_features for _, w in parts]
        if offsets != [sum(rows[:i]) for i in range(len(rows))] or sum(rows) != linear.out_features:
            raise ValueError(f"FP8 checkpoint: the parts of {path} cover rows {offsets} + "
                             f"{rows}, expected {linear.out_features} rows in order")
        _check_in(linear, parts[0][1], path)
        _replace(model, path, fused_quantized_linear([w for _, w in parts], _bias_like(linear)))
    for path, weight in plan.single.items():
        linear = _existing(model, path, path + ".weight")
        if not isinstance(linear, nn.Linear) or ".layers." not in f".{path}":
            # A bare weight read as a tensor (kv_b_proj), or one outside the decoder layers
            # (the LM head / embeddings of an unusual checkpoint): dense in the model dtype.
            dense_weight = getattr(linear, "weight", None)
            if not isinstance(dense_weight, Tensor):
                raise ValueError(f"unexpected FP8 checkpoint tensor {path}.weight")
            if not path.endswith(".kv_b_proj"):
                logger.warning("FP8 weight %s is kept dequantized in %s", path, dense_weight.dtype)
            dense.append((path + ".weight", weight.dequantize(dense_weight.dtype)))
            continue
        if weight.shape != (linear.out_features, linear.in_features):
            raise ValueError(f"FP8 checkpoint tensor {path}.weight has shape {list(weight.shape)}, "
                             f"expected {[linear.out_features, linear.in_features]}")
        _replace(model, path, QuantizedLinear(weight, _bias_like(linear)))
    return dense


def _check_in(linear: nn.Module, weight: QuantizedWeight, path: str) -> None:
    if weight.in_features != linear.in_features:
        raise ValueError(f"FP8 checkpoint: {path} parts have {weight.in_features} inputs, "
                         f"expected {linear.in_features}")


def _install_experts(model: nn.Module, plan: _Plan) -> None:
    for path, by_expert in plan.experts.items():
        experts = _existing(model, path, path)
        num, inter = experts.num_experts, experts.intermediate_size
        if sorted(by_expert) != list(range(num)):
            missing = sorted(set(range(num)) - set(by_expert))
            raise ValueError(f"FP8 checkpoint is missing experts {missing[:5]} of {path}")
        if hasattr(experts, "load_quantized_experts"):  # an expert-parallel rank's slots
            experts.load_quantized_experts(by_expert)
            continue
        gate_up, down = [], []
        for e in range(num):
            w = by_expert[e]
            parts = [w["gate_up_proj"]] if "gate_up_proj" in w else [w.get("gate_proj"), w.get("up_proj")]
            if any(p is None for p in parts) or "down_proj" not in w:
                raise ValueError(f"FP8 checkpoint is missing weights of expert {e} in {path}")
            hidden = w["down_proj"].out_features
            if sum(p.out_features for p in parts) != 2 * inter or parts[0].in_features != hidden \
                    or w["down_proj"].in_features != inter:
                raise ValueError(f"FP8 checkpoint: expert {e} of {path} has the wrong shape")
            gate_up.append(fused_quantized_linear(parts))
            down.append(QuantizedLinear(w["down_proj"]))
        _replace(model, path, QuantizedMoEExperts(gate_up, down, inter))


def load_fp8_weights(model: nn.Module, checkpoint, quant: Fp8BlockQuantConfig,
                     skip_prefixes: tuple[str, ...] = ()) -> None:
    """Fill `model` (just built, unfilled) from an FP8 `checkpoint` (an HFCheckpoint).
    Routed-expert modules with `load_quantized_experts` (an expert-parallel rank's slots)
    take their experts' weights; their parameters are under `skip_prefixes`."""
    config = model.config
    tensors = read_fp8_tensors(checkpoint.weight_files, config)
    device = next(model.parameters()).device
    plan = plan_modules(tensors, config, quant, device)
    with torch.no_grad():
        dense = _install_linears(model, plan)
        _install_experts(model, plan)
        skip = {n for n in tensors if not n.endswith(SCALE_SUFFIX)}
        load_hf_named_weights(model, _chain(plain_tensors(checkpoint.weight_files, skip), dense),
                              skip_prefixes=skip_prefixes)
    logger.info("FP8 checkpoint: %d fused / %d single linear layers and %d expert groups "
                "kept in FP8", len(plan.fused), len(plan.single), len(plan.experts))


def _chain(*iterables):
    for it in iterables:
        yield from it
