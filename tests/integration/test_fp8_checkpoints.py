"""Block-scaled FP8 checkpoints (DeepSeek-V3 and Qwen3 release layout, tests/integration/
fp8_checkpoints.py) against transformers on their dequantized fp32 copies: greedy tokens and
log-probs through the engine (chunked prefill, the MLA latent cache with the absorbed decode),
logits of the bare model in bf16, weights resident in FP8 (within 1.15x of the checkpoint's
bytes) and clear load errors for what the loader cannot honour."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from deepinfer.quant.fused_quantized import QuantizedMoEExperts
from deepinfer.quant.quantized_linear import QuantizedLinear
from deepinfer.models.quantized_model import weight_bytes_by_format
from deepinfer.runtime.model_source import load_model, resolve_model
from tests.integration.engine_checks import generate_checked, token_prompts
from tests.integration.fp8_checkpoints import FP8_KINDS, fp8_hf_model, write_fp8_pair
from tests.integration.moe_checkpoints import random_prompts
from tests.integration.test_moe_engine_reference import (GREEDY, TinyReference,
                                                         assert_outputs_match, make_llm)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def fp8_setups(tmp_path_factory, default_model_source):
    """kind -> (TinyReference on the dequantized copy, fp8 dir, ref dir, checkpoint bytes)."""
    from transformers import AutoModelForCausalLM

    tokenizer = default_model_source.load_tokenizer()
    out = {}
    for i, kind in enumerate(FP8_KINDS):
        root = tmp_path_factory.mktemp(f"fp8_{kind}")
        fp8_dir, ref_dir = str(root / "fp8"), str(root / "ref")
        sizes = write_fp8_pair(fp8_hf_model(kind, seed=40 + i), fp8_dir, ref_dir, tokenizer,
                               fused_experts=kind.endswith("_fused"))
        reference = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
        out[kind] = (TinyReference(reference), fp8_dir, ref_dir, sizes["fp8"])
    return out


@pytest.mark.parametrize("kind", FP8_KINDS)
def test_fp8_engine_matches_transformers_on_dequantized_weights(fp8_setups, kind):
    reference, fp8_dir, _, _ = fp8_setups[kind]
    prompts = random_prompts(seed=11, lengths=(3, 17, 60, 130))
    llm = make_llm(fp8_dir, enable_prefix_caching=False, max_num_batched_tokens=48)
    assert_outputs_match(reference, generate_checked(llm, token_prompts(prompts), GREEDY),
                         prompts, f"fp8 {kind}")


def test_fp8_modules_stay_quantized(fp8_setups):
    """Which module each part of the checkpoint became, and that no FP8 weight was expanded:
    partial blocks keep fused parts apart, aligned ones stack into one matrix."""
    def modules(kind):
        return load_model(resolve_model(fp8_setups[kind][1]), torch.bfloat16)

    def num_parts(linear) -> int:
        assert isinstance(linear, QuantizedLinear) and linear.formats[0] == "fp8_block"
        return len(linear.parts)

    partial, aligned = modules("qwen3_partial"), modules("qwen3_aligned")
    for model, parts in ((partial, (3, 2)), (aligned, (1, 1))):
        layer = model.model.layers[0]
        assert num_parts(layer.self_attn.qkv_proj) == parts[0]
        assert num_parts(layer.mlp.gate_up_proj) == parts[1]
        assert num_parts(layer.self_attn.o_proj) == 1
        assert isinstance(model.lm_head, torch.nn.Linear)  # LM head and embeddings stay bf16
        assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert aligned.model.layers[0].self_attn.qkv_proj.qweight.scale.shape == (4, 2)
    moe = modules("qwen3_moe")
    assert isinstance(moe.model.layers[0].mlp.experts, QuantizedMoEExperts)
    assert num_parts(moe.model.layers[1].mlp.gate_up_proj) == 1  # 2 x 256 rows: stacked
    assert moe.model.layers[0].mlp.gate.weight.dtype == torch.bfloat16  # the router
    ds = modules("deepseek_v3")
    attn = ds.model.layers[1].self_attn
    for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"):
        assert num_parts(getattr(attn, name)) == 1, name
    assert attn.kv_b_proj.weight.dtype == torch.bfloat16  # dequantized for the per-head fold
    mlp = ds.model.layers[1].mlp
    assert isinstance(mlp.experts, QuantizedMoEExperts)
    assert num_parts(mlp.shared_experts.gate_up_proj) == 2  # 136-row halves
    assert mlp.gate.e_score_correction_bias.dtype == torch.float32
    assert num_parts(ds.model.layers[0].mlp.gate_up_proj) == 2


@pytest.mark.parametrize("kind", ["qwen3_partial", "qwen3_aligned", "qwen3_moe", "deepseek_v3"])
def test_bf16_fp8_model_tracks_the_reference(fp8_setups, kind):
    """In bf16 (the FP8 x bf16 kernel on CPU) the logits follow transformers' fp32 logits on
    the dequantized copy as closely as our bf16 model of that copy does (MoE routing may flip
    at a few positions in bf16, on either side)."""
    from deepinfer.layers.attention import ContiguousCausalAttention
    from deepinfer.layers.mla import ContiguousMLAAttention

    reference, fp8_dir, ref_dir, _ = fp8_setups[kind]
    fp8, dense = (load_model(resolve_model(d), torch.bfloat16) for d in (fp8_dir, ref_dir))
    ids = torch.tensor(random_prompts(seed=12, lengths=(24,))[0])
    with torch.no_grad():
        want = reference.model(ids.unsqueeze(0)).logits[0].float()

    def errors(model):
        attn = ContiguousMLAAttention() if kind == "deepseek_v3" else ContiguousCausalAttention()
        with torch.no_grad():
            got = model.compute_logits(model(ids, torch.arange(len(ids)), attn))
        return ((got - want).abs().median().item(),
                (got.argmax(-1) == want.argmax(-1)).float().mean().item())

    (fp8_err, fp8_agree), (dense_err, dense_agree) = errors(fp8), errors(dense)
    assert fp8_err < max(2 * dense_err, 0.02 * want.abs().max().item()), (fp8_err, dense_err)
    assert fp8_agree >= min(dense_agree, 0.9) - 1 / len(ids), (fp8_agree, dense_agree)


@pytest.mark.parametrize("kind", FP8_KINDS)
def test_resident_weights_within_1_15x_of_checkpoint(fp8_setups, kind):
    from deepinfer import LLM

    _, fp8_dir, _, checkpoint_bytes = fp8_setups[kind]
    llm = LLM(model=fp8_dir, dtype="bfloat16", kv_cache_memory="16MiB")
    by_format = weight_bytes_by_format(llm.engine.model)
    assert by_format["fp8_block"] + by_format["fp8_block scales"] > 0.6 * checkpoint_bytes
    assert sum(by_format.values()) <= 1.15 * checkpoint_bytes, by_format


def _variant(src: str, dst, edit_config=None, edit_tensors=None) -> str:
    """A copy of checkpoint `src` with its config / tensors changed."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if edit_config is not None:
        path = os.path.join(dst, "config.json")
        with open(path) as f:
            config = json.load(f)
        edit_config(config)
        with open(path, "w") as f:
            json.dump(config, f)
    if edit_tensors is not None:
        path = os.path.join(dst, "model.safetensors")
        tensors = load_file(path)
        edit_tensors(tensors)
        save_file(tensors, path, metadata={"format": "pt"})
    return str(dst)


LAYER0 = "model.layers.0.self_attn.q_proj.weight"
X_PROJ = "model.layers.0.self_attn.x_proj.weight"


@pytest.mark.parametrize("edit_config, edit_tensors, message", [
    (lambda c: c["quantization_config"].update(activation_scheme="static"), None, "static"),
    (lambda c: c["quantization_config"].update(fmt="e5m2"), None, "e5m2"),
    (lambda c: c["quantization_config"].update(weight_block_size=[128]), None, "weight_block_size"),
    (lambda c: c["quantization_config"].update(quant_method="gptq"), None, "gptq"),
    (lambda c: c["quantization_config"].update(group_size=64), None, "group_size"),
    (lambda c: c["quantization_config"].update(modules_to_not_convert=["self_attn.q_proj"]), None,
     "modules_to_not_convert"),
    (None, lambda t: t.pop(LAYER0 + "_scale_inv"), "no scale"),
    (None, lambda t: t.pop(LAYER0), "without its weight"),
    (None, lambda t: t.update({LAYER0 + "_scale_inv": t[LAYER0 + "_scale_inv"][:1]}), "scale"),
    (None, lambda t: t.update({X_PROJ: t[LAYER0].clone(),
                               X_PROJ + "_scale_inv": t[LAYER0 + "_scale_inv"].clone()}),
     "unexpected FP8 checkpoint tensor"),
])
def test_unsupported_fp8_checkpoints_are_clear_load_errors(fp8_setups, tmp_path, edit_config,
                                                           edit_tensors, message):
    src = fp8_setups["qwen3_partial"][1]
    path = _variant(src, tmp_path / "bad", edit_config, edit_tensors)
    with pytest.raises(ValueError, match=message):
        load_model(resolve_model(path), torch.float32)


def test_modules_to_not_convert_load_unquantized(fp8_setups, tmp_path):
    """A module the config lists is read as stored (bf16) and stays a dense linear."""
    from safetensors.torch import load_file

    _, src, ref_dir, _ = fp8_setups["qwen3_partial"]
    ref = load_file(os.path.join(ref_dir, "model.safetensors"))
    name = "model.layers.1.self_attn.o_proj.weight"

    def unquantize(tensors):
        tensors.pop(name + "_scale_inv")
        tensors[name] = ref[name].to(torch.bfloat16)

    path = _variant(src, tmp_path / "skip", lambda c: c["quantization_config"].update(
        modules_to_not_convert=["lm_head", "model.layers.1.self_attn.o_proj"]), unquantize)
    model = load_model(resolve_model(path), torch.float32)
    assert isinstance(model.model.layers[1].self_attn.o_proj, torch.nn.Linear)
    assert isinstance(model.model.layers[0].self_attn.o_proj, QuantizedLinear)
    assert torch.equal(model.model.layers[1].self_attn.o_proj.weight, ref[name].to(torch.bfloat16).float())
