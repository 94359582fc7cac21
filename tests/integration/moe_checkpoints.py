"""Tiny random-weight MoE checkpoints (Mixtral, Qwen3-MoE, DeepSeek-V3) for reference tests.

Every parameter is re-drawn from a seeded generator. Router and LM-head weights are drawn ~5x
larger than the rest so that expert choices and greedy tokens are decisive (score gaps far
above fp32 noise), and
DeepSeek's `e_score_correction_bias` is non-zero so that selection differs from the weights.
Checkpoints are written by transformers' `save_pretrained` (per-expert tensors).
"""
from __future__ import annotations

import torch

from tests.integration.tiny_models import seeded_random_model

VOCAB = 256

_ATTN = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
             max_position_embeddings=1024, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
             tie_word_embeddings=False)


def tiny_moe_config(kind: str):
    """A transformers config for one of MOE_KINDS."""
    from transformers import DeepseekV3Config, MixtralConfig, Qwen3MoeConfig

    if kind == "mixtral":
        return MixtralConfig(**_ATTN, num_key_value_heads=2, intermediate_size=48,
                             num_local_experts=8, num_experts_per_tok=2, rope_theta=1000.0,
                             sliding_window=None)
    if kind == "qwen3_moe":  # softmax top-k without renormalisation, explicit head_dim
        return Qwen3MoeConfig(**_ATTN, num_key_value_heads=2, head_dim=32, intermediate_size=96,
                              moe_intermediate_size=32, num_experts=8, num_experts_per_tok=3,
                              norm_topk_prob=False, rope_theta=1000.0)
    if kind == "qwen3_moe_sparse_step":  # every 2nd layer sparse, layer 3 forced dense, renormalised
        cfg = dict(_ATTN, num_hidden_layers=4)
        return Qwen3MoeConfig(**cfg, num_key_value_heads=1, intermediate_size=80,
                              moe_intermediate_size=24, num_experts=6, num_experts_per_tok=2,
                              norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=[3],
                              rope_theta=1000.0)
    if kind == "deepseek_v3":  # q_lora, grouped routing with bias, dense first layer, YaRN, interleaved rope
        return DeepseekV3Config(
            **_ATTN, intermediate_size=96, moe_intermediate_size=24, n_routed_experts=8,
            n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
            first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
            q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=24, rope_interleave=True,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 256, "mscale": 0.9,
                             "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1})
    if kind == "deepseek_v3_no_q_lora":  # plain q_proj, one group, no renorm, plain rope layout
        return DeepseekV3Config(
            **_ATTN, intermediate_size=96, moe_intermediate_size=16, n_routed_experts=6,
            n_shared_experts=2, num_experts_per_tok=3, n_group=1, topk_group=1,
            first_k_dense_replace=0, routed_scaling_factor=1.5, norm_topk_prob=False,
            q_lora_rank=None, kv_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8,
            v_head_dim=16, rope_interleave=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    if kind == "deepseek_v2":  # softmax group-limited greedy, V2-Lite style (no q_lora)
        from transformers import DeepseekV2Config
        return DeepseekV2Config(
            **_ATTN, intermediate_size=96, moe_intermediate_size=16, n_routed_experts=8,
            n_shared_experts=2, num_experts_per_tok=3, topk_method="group_limited_greedy",
            n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.0,
            q_lora_rank=None, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    raise ValueError(kind)


MOE_KINDS = ["mixtral", "qwen3_moe", "qwen3_moe_sparse_step", "deepseek_v3", "deepseek_v3_no_q_lora",
             "deepseek_v2"]


def _moe_std(name: str) -> float:
    if name.endswith("mlp.gate.weight"):  # routers: decisive expert choices
        return 0.5
    if name == "lm_head.weight":  # logits spread wide: top-2 gaps far above fp32 noise
        return 0.4
    return 0.08


def tiny_moe_model(kind: str, seed: int = 0, **overrides):
    """A seeded fp32 transformers model with every parameter (and the DeepSeek bias) random."""
    config = tiny_moe_config(kind)
    for key, value in overrides.items():
        setattr(config, key, value)
    model, gen = seeded_random_model(config, seed, _moe_std)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.3 * torch.randn(buf.shape, generator=gen))
    return model


def random_prompts(seed: int, lengths=(1, 7, 40)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def add_mtp_layer(directory, seed: int = 0, copy_head: bool = True, echo: bool = False) -> None:
    """Append a DeepSeek-V3 multi-token-prediction layer to a tiny `save_pretrained`
    checkpoint, as DeepSeek's releases store it (transformers writes none): tensors
    `model.layers.{N}.*` (N = num_hidden_layers) shaped like the last decoder layer's, plus
    `enorm`, `hnorm`, `eh_proj`, `embed_tokens` and `shared_head.{norm,head}`, and
    `num_nextn_predict_layers: 1` in config.json. Random like the other weights; with
    `copy_head` the MTP embedding and head are the model's own (as in DeepSeek-V3).
    `echo`: a layer that predicts the token the target just predicted (eh_proj passes the
    target's hidden state through, the block adds nothing, unit norms), so its drafts are
    accepted exactly where the target repeats a token."""
    import json
    import os

    from safetensors.torch import load_file, save_file

    path = os.path.join(directory, "model.safetensors")
    tensors = load_file(path)
    with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    n, hidden = config["num_hidden_layers"], config["hidden_size"]
    gen = torch.Generator().manual_seed(seed)
    last = f"model.layers.{n - 1}."
    mtp = f"model.layers.{n}."
    for name, t in list(tensors.items()):
        if name.startswith(last):
            if name.endswith("norm.weight"):
                value = 1.0 + 0.2 * torch.randn(t.shape, generator=gen)
            elif name.endswith("mlp.gate.weight"):
                value = 0.5 * torch.randn(t.shape, generator=gen)
            elif name.endswith("e_score_correction_bias"):
                value = 0.3 * torch.randn(t.shape, generator=gen)
            else:
                value = 0.08 * torch.randn(t.shape, generator=gen)
            tensors[mtp + name[len(last):]] = value.to(t.dtype).contiguous()
    embed, head = tensors["model.embed_tokens.weight"], tensors["lm_head.weight"]
    extra = {
        "enorm.weight": 1.0 + 0.2 * torch.randn(hidden, generator=gen),
        "hnorm.weight": 1.0 + 0.2 * torch.randn(hidden, generator=gen),
        "eh_proj.weight": 0.08 * torch.randn(hidden, 2 * hidden, generator=gen),
        "shared_head.norm.weight": 1.0 + 0.2 * torch.randn(hidden, generator=gen),
        "embed_tokens.weight": embed.clone() if copy_head else 0.08 * torch.randn(embed.shape, generator=gen),
        "shared_head.head.weight": head.clone() if copy_head else 0.4 * torch.randn(head.shape, generator=gen),
    }
    if echo:
        extra["eh_proj.weight"] = torch.cat([torch.zeros(hidden, hidden), torch.eye(hidden)], dim=1)
        for name in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
            extra[name] = torch.ones(hidden)
        for name in list(tensors):
            if name.startswith(mtp) and name.endswith(("o_proj.weight", "down_proj.weight")):
                tensors[name] = torch.zeros_like(tensors[name])
    for name, value in extra.items():
        tensors[mtp + name] = value.to(embed.dtype).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
    config["num_nextn_predict_layers"] = 1
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
