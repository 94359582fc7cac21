"""Tiny block-scaled FP8 checkpoints in the release layout (DeepSeek-V3, Qwen3-FP8), each with
its dequantized fp32 copy for transformers.

`write_fp8_pair(model, fp8_dir, ref_dir)` saves a seeded fp32 transformers model (per-expert
names, as `save_pretrained` writes them) and converts it: every projection weight of the
decoder layers is quantized per 128 x 128 block to float8_e4m3fn with a float32
`<name>_scale_inv` (scale = max|block| / 448; the last blocks of a matrix partial), every other
tensor becomes bf16 (DeepSeek's `e_score_correction_bias` stays fp32), and config.json gains
DeepSeek's `quantization_config`. The reference directory holds exactly the values the FP8
checkpoint encodes (the dequantized weights, the bf16-rounded rest) in fp32.
"""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file

from deepinfer.quant.quantized_weight import quantize_fp8_block

QUANT_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [128, 128]}
FP8_KINDS = ["qwen3_partial", "qwen3_aligned", "qwen3_moe", "qwen3_moe_fused", "deepseek_v3"]
_EXPERT_PROJ = ("gate_proj", "up_proj", "down_proj")


def fp8_hf_config(kind: str):
    """A transformers config: partial blocks everywhere (192 = 128 + 64, 320 = 2.5 blocks), or
    dimensions on block boundaries (the fused parts stack into one FP8 matrix)."""
    from transformers import DeepseekV3Config, Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=256, num_hidden_layers=2, max_position_embeddings=1024,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                  rope_theta=1000.0)
    if kind == "qwen3_partial":
        return Qwen3Config(**common, hidden_size=192, intermediate_size=320,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=48)
    if kind == "qwen3_aligned":
        return Qwen3Config(**common, hidden_size=256, intermediate_size=384,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    if kind in ("qwen3_moe", "qwen3_moe_fused"):  # a dense layer 1, 160 = 1.25 blocks
        return Qwen3MoeConfig(**common, hidden_size=192, intermediate_size=256,
                              moe_intermediate_size=160, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=48, num_experts=6,
                              num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1])
    if kind in ("deepseek_v3", "deepseek_v3_aligned"):
        # MLA, grouped routing + bias, a shared expert, dense layer 0; "aligned": experts of
        # 128 rows (expert parallelism stacks each slot's gate and up)
        return DeepseekV3Config(
            **{**common, "num_hidden_layers": 3}, hidden_size=160, intermediate_size=288,
            moe_intermediate_size=136 if kind == "deepseek_v3" else 128, n_routed_experts=8, n_shared_experts=1,
            num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1,
            routed_scaling_factor=2.5, norm_topk_prob=True, num_attention_heads=4,
            q_lora_rank=136, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
            v_head_dim=48, rope_interleave=True,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 256, "mscale": 0.9,
                             "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1})
    raise ValueError(kind)


def fp8_hf_model(kind: str, seed: int):
    from tests.integration.moe_checkpoints import _moe_std
    from tests.integration.tiny_models import seeded_random_model

    model, gen = seeded_random_model(fp8_hf_config(kind), seed, _moe_std)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.3 * torch.randn(buf.shape, generator=gen))
    return model


def is_projection(name: str, tensor: torch.Tensor) -> bool:
    """A linear weight of a decoder layer (not a norm, not a router): quantized in releases."""
    return (name.startswith("model.layers.") and name.endswith(".weight") and tensor.dim() == 2
            and not name.endswith(("norm.weight", "mlp.gate.weight")))


def write_fp8_pair(model, fp8_dir: str, ref_dir: str, tokenizer=None, fused_experts: bool = False,
                   quant_config: dict | None = None) -> dict[str, int]:
    """Write both directories; returns {"fp8": bytes, "fp32": bytes} of the weight files."""
    model.save_pretrained(ref_dir)
    tensors = load_file(os.path.join(ref_dir, "model.safetensors"))
    fp8, ref = {}, {}
    for name, t in tensors.items():
        if is_projection(name, t):
            q = quantize_fp8_block(t.float())
            fp8[name], fp8[name + "_scale_inv"] = q.data, q.scale
            ref[name] = q.dequantize(torch.float32)
        else:
            kept = t.float() if name.endswith("e_score_correction_bias") else t.to(torch.bfloat16)
            fp8[name], ref[name] = kept.contiguous(), kept.float()
    if fused_experts:
        _fuse_experts(fp8, ref)
    save_file(ref, os.path.join(ref_dir, "model.safetensors"), metadata={"format": "pt"})
    os.makedirs(fp8_dir, exist_ok=True)
    save_file(fp8, os.path.join(fp8_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(ref_dir, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config["quantization_config"] = quant_config or QUANT_CONFIG
    config["torch_dtype"] = "bfloat16"
    with open(os.path.join(fp8_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    if tokenizer is not None:
        tokenizer.save_pretrained(fp8_dir)
        tokenizer.save_pretrained(ref_dir)
    return {kind: os.path.getsize(os.path.join(d, "model.safetensors"))
            for kind, d in (("fp8", fp8_dir), ("fp32", ref_dir))}


def _fuse_experts(fp8: dict, ref: dict) -> None:
    """Per-expert FP8 tensors -> transformers' fused 3-D `experts.gate_up_proj` [E, 2I, H] and
    `experts.down_proj` [E, H, I], each expert's matrix quantized as one (gate rows first);
    the reference keeps per-expert names with the values the fused tensors encode."""
    prefixes = sorted({n.split(".experts.")[0] for n in fp8 if ".mlp.experts." in n})
    for prefix in prefixes:
        experts = sorted({int(n.split(".experts.")[1].split(".")[0])
                          for n in fp8 if n.startswith(prefix + ".experts.")})
        gate_up, down = [], []
        for e in experts:
            names = {p: f"{prefix}.experts.{e}.{p}.weight" for p in _EXPERT_PROJ}
            for n in names.values():
                fp8.pop(n), fp8.pop(n + "_scale_inv")
            rows = torch.cat([ref[names["gate_proj"]], ref[names["up_proj"]]])
            q = quantize_fp8_block(rows)
            gate_up.append(q)
            value = q.dequantize(torch.float32)
            inter = ref[names["gate_proj"]].shape[0]
            ref[names["gate_proj"]], ref[names["up_proj"]] = value[:inter].clone(), value[inter:].clone()
            down.append(quantize_fp8_block(ref[names["down_proj"]]))
            ref[names["down_proj"]] = down[-1].dequantize(torch.float32)
        for proj, qs in (("gate_up_proj", gate_up), ("down_proj", down)):
            fp8[f"{prefix}.experts.{proj}"] = torch.stack([q.data for q in qs])
            fp8[f"{prefix}.experts.{proj}_scale_inv"] = torch.stack([q.scale for q in qs])
