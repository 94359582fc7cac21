"""Our MoE models (Mixtral, Qwen3-MoE, DeepSeek-V3 with MLA) vs transformers fp32 on tiny
random-weight checkpoints written by `save_pretrained` (per-expert tensors) and read back
through `resolve_model`: config parsing, expert stacking, routing and latent attention.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer.layers.attention import ContiguousCausalAttention
from deepinfer.layers.mla import ContiguousMLAAttention
from deepinfer.runtime.model_source import load_model, resolve_model
from tests.integration.moe_checkpoints import MOE_KINDS, random_prompts, tiny_moe_model

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def saved_moe_models(tmp_path_factory):
    """kind -> (HF model, directory). DeepSeek-V3 is saved in several shards."""
    out = {}
    for i, kind in enumerate(MOE_KINDS):
        model = tiny_moe_model(kind, seed=10 + i)
        directory = tmp_path_factory.mktemp(kind)
        model.save_pretrained(directory, max_shard_size="200KB" if kind == "deepseek_v3" else "50GB")
        out[kind] = (model, str(directory))
    return out


@torch.no_grad()
def our_logits(model, token_ids: list[int], absorbed: bool = False) -> torch.Tensor:
    attn = ContiguousMLAAttention(absorbed) if model.config.mla is not None else ContiguousCausalAttention()
    hidden = model(torch.tensor(token_ids), torch.arange(len(token_ids)), attn)
    return model.compute_logits(hidden)


@torch.no_grad()
def hf_logits(model, token_ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([token_ids])).logits[0].float()


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_logits_match_transformers_fp32(saved_moe_models, kind):
    hf_model, directory = saved_moe_models[kind]
    model = load_model(resolve_model(directory), torch.float32)
    for ids in random_prompts(seed=1, lengths=(1, 7, 40, 300)):
        ours, ref = our_logits(model, ids), hf_logits(hf_model, ids)
        assert ours.shape == ref.shape
        assert (ours - ref).abs().max().item() <= 2e-4 * max(1.0, ref.abs().max().item()), kind
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))
        # Decisive: logits vary across positions, so agreeing argmaxes mean something.
        assert ref.std().item() > 0.1


@pytest.mark.parametrize("kind", ["deepseek_v3", "deepseek_v3_no_q_lora"])
def test_absorbed_mla_equals_expanded(saved_moe_models, kind):
    model = load_model(resolve_model(saved_moe_models[kind][1]), torch.float32)
    ids = random_prompts(seed=3, lengths=(50,))[0]
    expanded, absorbed = our_logits(model, ids), our_logits(model, ids, absorbed=True)
    assert (expanded - absorbed).abs().max().item() < 1e-4


def test_configs_reflect_moe_features(saved_moe_models):
    cfg = {k: resolve_model(saved_moe_models[k][1]).config for k in MOE_KINDS}
    assert cfg["mixtral"].moe.num_experts == 8 and cfg["mixtral"].moe.norm_topk_prob
    assert not cfg["qwen3_moe"].moe.norm_topk_prob and cfg["qwen3_moe"].qk_norm
    # decoder_sparse_step=2 -> layers 1, 3 sparse; mlp_only_layers=[3] -> only layer 1.
    assert cfg["qwen3_moe_sparse_step"].moe.dense_layers == frozenset({0, 2, 3})
    ds = cfg["deepseek_v3"]
    assert ds.moe.dense_layers == frozenset({0}) and ds.moe.n_group == 4 and ds.moe.use_correction_bias
    assert ds.mla.q_lora_rank == 48 and ds.mla.cache_entry_dim == 40
    assert ds.rope_scaling["rope_type"] == "yarn" and ds.mla.softmax_scale > 24 ** -0.5
    assert cfg["deepseek_v3_no_q_lora"].mla.q_lora_rank is None
    with open(os.path.join(saved_moe_models["deepseek_v3"][1], "model.safetensors.index.json")) as f:
        assert len(set(json.load(f)["weight_map"].values())) > 1


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_num_params_formula_matches_modules(saved_moe_models, kind):
    hf_model, directory = saved_moe_models[kind]
    config = resolve_model(directory).config
    hf_count = sum(p.numel() for p in hf_model.parameters())
    hf_count += sum(b.numel() for n, b in hf_model.named_buffers() if n.endswith("e_score_correction_bias"))
    assert config.num_params() == hf_count
    ours = load_model(resolve_model(directory), torch.float32)
    assert config.num_params() == sum(p.numel() for p in ours.parameters())
    assert config.num_active_params() < config.num_params() - config.vocab_size * config.hidden_size


def test_fused_expert_tensors_load_like_per_expert(saved_moe_models, tmp_path):
    """A checkpoint with HF-v5 fused 3-D expert tensors gives the same model."""
    hf_model, directory = saved_moe_models["qwen3_moe"]
    state = {}
    for name, tensor in load_file(os.path.join(directory, "model.safetensors")).items():
        if ".mlp.experts." not in name:
            state[name] = tensor
    for name, p in hf_model.named_parameters():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            state[name] = p.detach().clone()
    save_file(state, str(tmp_path / "model.safetensors"))
    with open(os.path.join(directory, "config.json")) as f:
        (tmp_path / "config.json").write_text(f.read())
    fused = load_model(resolve_model(str(tmp_path)), torch.float32)
    per_expert = load_model(resolve_model(directory), torch.float32)
    for (n1, p1), (n2, p2) in zip(fused.named_parameters(), per_expert.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2), n1


def test_mixtral_names_and_missing_expert_errors(saved_moe_models):
    hf_model, directory = saved_moe_models["mixtral"]
    source = resolve_model(directory)
    weights = dict(source.iter_weights())
    assert any(".block_sparse_moe.experts.3.w2." in n for n in weights)
    model_cls = type(load_model(source, torch.float32))
    model = model_cls(source.config)
    with pytest.raises(ValueError, match="missing"):
        model.load_weights((k, v) for k, v in weights.items() if "experts.5.w3" not in k)
    with pytest.raises(ValueError, match="num_experts"):
        model.load_weights([*weights.items(),
                            ("model.layers.0.block_sparse_moe.experts.8.w1.weight", torch.zeros(48, 64))])


@pytest.mark.parametrize("change, message", [
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"topk_method": "greedy"}, "topk_method"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"n_group": 3}, "n_group"),
    ({"moe_layer_freq": 2}, "moe_layer_freq"),
    ({"quantization_config": {"quant_method": "awq"}}, "quant_method"),
    ({"quantization_config": {"quant_method": "fp8"}}, "weight_block_size"),
])
def test_unsupported_deepseek_config_values_are_load_errors(saved_moe_models, tmp_path, change, message):
    with open(os.path.join(saved_moe_models["deepseek_v3"][1], "config.json")) as f:
        cfg = json.load(f)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **change}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=message):
        resolve_model(str(tmp_path))
