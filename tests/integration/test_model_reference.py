"""Our Llama-family model vs Hugging Face transformers on tiny random-weight checkpoints.

Each checkpoint is written with `save_pretrained` and read back through `resolve_model`, so
the test covers config parsing, the safetensors loader (single and sharded), the q/k/v and
gate/up fusion, tied embeddings, RoPE scaling, q/k/v biases and per-head q/k norms.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from deepinfer.models.llama import LlamaForCausalLM
from deepinfer.runtime.model_source import load_model, resolve_model
from tests.integration.tiny_models import hf_logits, our_logits, prompts, tiny_hf_model

KINDS = ["llama", "llama_tied", "qwen2", "qwen3", "mistral"]


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory):
    """kind -> (HF model, directory). Qwen2 is saved in several shards."""
    out = {}
    for kind in KINDS:
        model = tiny_hf_model(kind, seed=KINDS.index(kind))
        directory = tmp_path_factory.mktemp(kind)
        shard = "40KB" if kind == "qwen2" else "50GB"
        model.save_pretrained(directory, max_shard_size=shard)
        out[kind] = (model, str(directory))
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers_fp32(saved_models, kind):
    hf_model, directory = saved_models[kind]
    source = resolve_model(directory)
    assert source.name == os.path.basename(directory)
    model = load_model(source, torch.float32)
    assert isinstance(model, LlamaForCausalLM)
    for ids in prompts(seed=1):
        ours, ref = our_logits(model, ids), hf_logits(hf_model, ids)
        assert ours.dtype == torch.float32 and ours.shape == ref.shape
        assert (ours - ref).abs().max().item() <= 1e-4, kind
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_config_reflects_architecture_features(saved_models):
    cfg = {k: resolve_model(saved_models[k][1]).config for k in KINDS}
    assert cfg["llama"].rope_scaling["rope_type"] == "llama3"
    assert cfg["llama_tied"].tie_word_embeddings and not cfg["llama"].tie_word_embeddings
    assert cfg["qwen2"].attention_bias and not cfg["qwen2"].o_proj_bias
    assert cfg["qwen3"].qk_norm and cfg["qwen3"].head_dim == 32
    assert cfg["mistral"].architecture == "mistral"
    assert all(c.eos_token_ids == (2,) and c.bos_token_id == 1 for c in cfg.values())


def test_sharded_checkpoint_is_read_from_index(saved_models):
    directory = saved_models["qwen2"][1]
    with open(os.path.join(directory, "model.safetensors.index.json")) as f:
        shards = set(json.load(f)["weight_map"].values())
    assert len(shards) > 1
    names = [name for name, _ in resolve_model(directory).iter_weights()]
    assert len(names) == len(set(names)) and "model.layers.1.self_attn.q_proj.bias" in names


def test_bfloat16_load_close_to_fp32_reference(saved_models):
    hf_model, directory = saved_models["llama"]
    model = load_model(resolve_model(directory), torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    ids = prompts(seed=2)[-1]
    ours, ref = our_logits(model, ids), hf_logits(hf_model, ids)
    assert ours.dtype == torch.float32
    # bf16 keeps ~3 significant digits; the tiny model's logits are O(1).
    assert (ours - ref).abs().max().item() < 0.1 * ref.abs().max().item()


def test_load_weights_rejects_bad_checkpoints(saved_models):
    hf_model, directory = saved_models["llama"]
    source = resolve_model(directory)
    weights = dict(source.iter_weights())
    model = LlamaForCausalLM(source.config)
    with pytest.raises(ValueError, match="missing"):
        model.load_weights((k, v) for k, v in weights.items() if "layers.1.mlp.up_proj" not in k)
    with pytest.raises(ValueError, match="unexpected"):
        model.load_weights([*weights.items(), ("model.layers.9.mlp.up_proj.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape"):
        model.load_weights({**weights, "model.norm.weight": torch.zeros(3)}.items())


def test_unloadable_paths_give_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        resolve_model(str(tmp_path / "nope.gguf"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model(str(tmp_path))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="cannot read GGUF"):
        resolve_model(str(bad))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unsupported"):
        resolve_model(str(tmp_path))


@pytest.mark.parametrize("kind", KINDS)
def test_num_params_formula_matches_modules(saved_models, kind):
    hf_model, directory = saved_models[kind]
    config = resolve_model(directory).config
    assert config.num_params() == sum(p.numel() for p in hf_model.parameters())
    ours = load_model(resolve_model(directory), torch.float32)
    assert config.num_params() == sum(p.numel() for p in ours.parameters())


def test_registry_maps_names_and_rejects_others():
    from deepinfer.models.registry import architecture_from_gguf, get_model_class

    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "qwen3"):
        assert get_model_class(name) is LlamaForCausalLM
    assert architecture_from_gguf("qwen2") == "qwen2"
    with pytest.raises(ValueError, match="unsupported"):
        get_model_class("GPT2LMHeadModel")
    with pytest.raises(ValueError, match="unsupported GGUF"):
        architecture_from_gguf("gemma3")


def test_hf_directory_tokenizer_and_generation_config_eos(tmp_path, saved_models, default_model_source):
    """A directory with tokenizer files and a generation_config listing extra stop ids."""
    hf_model, _ = saved_models["llama"]
    hf_model.save_pretrained(tmp_path)
    default_model_source.load_tokenizer().save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    source = resolve_model(str(tmp_path))
    assert source.config.eos_token_ids == (2, 5)
    tokenizer = source.load_tokenizer()
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    assert tokenizer("Hello world").input_ids == default_model_source.load_tokenizer()("Hello world").input_ids


def test_bf16_logits_top_candidates_are_exact(saved_models):
    """compute_logits recomputes the largest bf16 logits in fp32 (no rounding-made ties)."""
    from deepinfer.models.llama import NUM_EXACT_LOGITS

    model = load_model(resolve_model(saved_models["llama_tied"][1]), torch.bfloat16)
    torch.manual_seed(0)
    hidden = torch.randn(5, model.config.hidden_size).to(torch.bfloat16) * 3
    exact = hidden.float() @ model.model.embed_tokens.weight.float().T  # [5, vocab]
    logits = model.compute_logits(hidden)
    top = exact.topk(NUM_EXACT_LOGITS // 2, dim=-1).indices
    assert torch.allclose(logits.gather(1, top), exact.gather(1, top), atol=1e-4, rtol=0)
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))
    rounded = torch.nn.functional.linear(hidden, model.model.embed_tokens.weight).float()
    assert (rounded - exact).abs().max() > 1e-3  # the plain bf16 matmul really does round
