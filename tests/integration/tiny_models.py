"""Tiny random-weight Hugging Face models of each supported architecture, for reference tests.

Every parameter is re-drawn from a seeded generator (norm weights around 1, non-zero biases)
so that a wrong name mapping, a missing bias or a swapped q/k row order changes the logits.
"""
from __future__ import annotations

import torch

VOCAB = 256

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_hf_config(kind: str):
    """A transformers config for `kind` in llama | llama_tied | qwen2 | qwen3 | mistral."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    if kind == "llama":  # llama3 rope scaling with a short original context so it matters
        return LlamaConfig(**_COMMON, rope_theta=10000.0, tie_word_embeddings=False, rope_scaling={
            "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16})
    if kind == "llama_tied":
        return LlamaConfig(**_COMMON, rope_theta=500.0, tie_word_embeddings=True)
    if kind == "qwen2":
        return Qwen2Config(**_COMMON, rope_theta=1000.0, tie_word_embeddings=False)
    if kind == "qwen3":  # explicit head_dim != hidden / heads
        return Qwen3Config(**_COMMON, head_dim=32, rope_theta=1000.0, tie_word_embeddings=False)
    if kind == "mistral":
        return MistralConfig(**_COMMON, rope_theta=1000.0, tie_word_embeddings=False, sliding_window=None)
    raise ValueError(kind)


def seeded_random_model(config, seed: int, std_of, model_class=None):
    """A fp32 transformers model from `config` whose parameters are all redrawn from one
    seeded generator: norm weights 1 + 0.2·N(0, 1), every other parameter `std_of(name)`·N(0, 1).
    Returns (model, generator) so a caller can keep drawing (e.g. buffers) from the same stream.
    `model_class`: the transformers class to build (default AutoModelForCausalLM)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    if model_class is None:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    else:
        model = model_class._from_config(config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(std_of(name) * torch.randn(p.shape, generator=gen))
    return model, gen


def tiny_hf_model(kind: str, seed: int = 0, **overrides):
    """A seeded fp32 transformers model with every parameter randomised."""
    config = tiny_hf_config(kind)
    for key, value in overrides.items():
        setattr(config, key, value)
    model, _ = seeded_random_model(config, seed,
                                   lambda name: 0.2 if name.endswith(".bias") else 0.08)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model


def prompts(seed: int = 0) -> list[list[int]]:
    """A few token-id prompts of different lengths (up to 40, past the llama3 original ctx)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (1, 7, 40)]


@torch.no_grad()
def hf_logits(model, token_ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([token_ids])).logits[0].float()


@torch.no_grad()
def our_logits(model, token_ids: list[int]) -> torch.Tensor:
    from deepinfer.layers.attention import ContiguousCausalAttention

    ids = torch.tensor(token_ids)
    hidden = model(ids, torch.arange(len(token_ids)), ContiguousCausalAttention())
    return model.compute_logits(hidden)
