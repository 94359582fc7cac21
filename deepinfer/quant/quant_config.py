"""A checkpoint's `quantization_config` (config.json), parsed and checked. Pure (stdlib only):
ModelConfig holds the result, and the cost model and simulator read ModelConfig.

Supported: block-scaled FP8 as DeepSeek-V3/R1 and the Qwen3 `-FP8` releases store it,

    {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
     "weight_block_size": [128, 128], "modules_to_not_convert": [...]}   (the last optional)

every linear projection of the decoder layers a `float8_e4m3fn` weight with a float32
`weight_scale_inv` per block; embeddings, LM head, norms and MoE routers unquantized. Anything
else (another method or format, static activation scales, an unknown key) is refused with
the setting named: a checkpoint read under the wrong assumption computes garbage.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_FP8_KEYS = {"quant_method", "fmt", "activation_scheme", "weight_block_size",
             "modules_to_not_convert", "ignored_layers"}
# Keys some writers add whose value here changes nothing (transformers' FineGrainedFP8Config).
_HARMLESS = {"dequantize": (False, None)}


@dataclass(frozen=True)
class Fp8BlockQuantConfig:
    """Block-scaled FP8 weights: W = q * scale_inv per [block_out, block_in] block."""

    weight_block_size: tuple[int, int] = (128, 128)
    # Module names (dotted paths, e.g. "lm_head", "model.layers.0.mlp", "mlp.gate") whose
    # weights are stored unquantized.
    modules_to_not_convert: tuple[str, ...] = ()

    quant_method = "fp8"

    def skips(self, module_name: str) -> bool:
        """Whether `module_name` (HF dotted name) is listed as not converted: an entry is a
        dotted sub-path of the name (so "mlp.gate" never matches "mlp.gate_proj")."""
        padded = f".{module_name}."
        return any(f".{entry}." in padded for entry in self.modules_to_not_convert)


def quant_config_from_hf(cfg: Any) -> Fp8BlockQuantConfig | None:
    """None for no `quantization_config`; ValueError naming the setting we cannot honour."""
    if cfg is None or cfg == {}:
        return None
    if not isinstance(cfg, dict):
        raise ValueError(f"quantization_config must be an object, got {type(cfg).__name__}")
    method = cfg.get("quant_method")
    if method != "fp8":
        raise ValueError(f"quantization_config: quant_method {method!r} is not supported "
                         "(supported: 'fp8' block-scaled checkpoints); use a bf16/fp32 "
                         "checkpoint instead")
    for key, value in cfg.items():
        if key in _HARMLESS and value in _HARMLESS[key]:
            continue
        if key not in _FP8_KEYS:
            raise ValueError(f"quantization_config: unknown setting {key!r}={value!r} for "
                             "quant_method 'fp8'")
    fmt = cfg.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"quantization_config: fmt {fmt!r} is not supported (only 'e4m3')")
    scheme = cfg.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(f"quantization_config: activation_scheme {scheme!r} is not supported "
                         "(only 'dynamic': activations stay in the model dtype)")
    block = cfg.get("weight_block_size")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ValueError(f"quantization_config: weight_block_size must be two positive integers "
                         f"(per-tensor FP8 is not supported), got {block!r}")
    return Fp8BlockQuantConfig(tuple(block), _module_list(cfg))


def _module_list(cfg: dict) -> tuple[str, ...]:
    names: list[str] = []
    for key in ("modules_to_not_convert", "ignored_layers"):
        value = cfg.get(key)
        if value is None:
            continue
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise ValueError(f"quantization_config: {key} must be a list of module names")
        names.extend(v.strip(".") for v in value)
    return tuple(dict.fromkeys(names))
