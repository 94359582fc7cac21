"""GGUF loading: dequantization of each supported type, q/k un-permutation, metadata -> config,
and the embedded default model against transformers' own GGUF loader."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from deepinfer.runtime.gguf_loader import dequantize_tensor, served_name_from_path, unpermute_qk_rows
from deepinfer.runtime.model_source import load_model, resolve_model
from tests.integration.tiny_gguf import llamacpp_permute, random_k_quant, roundtrip, write_gguf
from tests.integration.tiny_models import hf_logits, our_logits, prompts, tiny_hf_model

# Worst-case |dequantized - original| as a fraction of the tensor's max |w|.
QUANT_ERROR_BOUND = {QT.F32: 0.0, QT.F16: 1e-3, QT.BF16: 8e-3, QT.Q8_0: 1 / 127, QT.Q4_0: 1 / 8, QT.Q4_1: 1 / 15}


def _hf_weights(hf_model) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in hf_model.state_dict().items()
            if not (k == "lm_head.weight" and hf_model.config.tie_word_embeddings)}


def _set_hf_weights(hf_model, weights: dict[str, np.ndarray]) -> None:
    with torch.no_grad():
        for name, p in hf_model.state_dict().items():
            if name in weights:
                p.copy_(torch.from_numpy(weights[name]))


def test_unpermute_inverts_llamacpp_permute():
    rng = np.random.default_rng(0)
    for heads, head_dim, cols in ((4, 16, 8), (2, 64, 3), (1, 8, 1)):
        w = rng.standard_normal((heads * head_dim, cols)).astype(np.float32)
        permuted = llamacpp_permute(w, heads)
        assert not np.array_equal(permuted, w)
        assert np.array_equal(unpermute_qk_rows(torch.from_numpy(permuted), heads).numpy(), w)


def test_served_name_strips_quant_suffix():
    assert served_name_from_path("/x/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct"
    assert served_name_from_path("Llama-3.2-1B-Instruct-Q4_K_M.gguf") == "Llama-3.2-1B-Instruct"
    assert served_name_from_path("qwen2.5-0.5b-instruct-fp16.gguf") == "qwen2.5-0.5b-instruct-fp16"
    assert served_name_from_path("model-bf16.gguf") == "model"


@pytest.mark.parametrize("qtype", [QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1], ids=lambda q: q.name)
def test_quantized_llama_gguf_matches_reference(tmp_path, qtype):
    """Permuted llama GGUF in `qtype` == HF model holding the same dequantized weights."""
    hf_model = tiny_hf_model("llama_tied", seed=3)
    original = _hf_weights(hf_model)
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    write_gguf(path, "llama", hf_model.config, original, qtype)
    source = resolve_model(str(path))
    assert source.config.tie_word_embeddings and source.config.num_key_value_heads == 2
    loaded = dict(source.iter_weights())
    assert set(loaded) == set(original)
    for name, w in original.items():
        err = np.abs(loaded[name].float().numpy() - w).max()
        assert err <= QUANT_ERROR_BOUND[qtype] * np.abs(w).max() + 1e-7, (name, err)
    # Row permutation commutes with row-wise block quantization: round-trip the HF layout.
    _set_hf_weights(hf_model, {k: roundtrip(w, qtype) for k, w in original.items()})
    model = load_model(source, torch.float32)
    for ids in prompts(seed=4):
        assert (our_logits(model, ids) - hf_logits(hf_model, ids)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_qwen_gguf_is_not_unpermuted(tmp_path, kind):
    """Qwen GGUFs keep HF row order; biases (qwen2) and q/k norms + head_dim (qwen3) load."""
    hf_model = tiny_hf_model(kind, seed=5)
    path = tmp_path / f"{kind}.gguf"
    write_gguf(path, kind, hf_model.config, _hf_weights(hf_model), QT.F32)
    source = resolve_model(str(path))
    assert source.config.architecture == kind
    assert source.config.attention_bias == (kind == "qwen2") and source.config.qk_norm == (kind == "qwen3")
    model = load_model(source, torch.float32)
    for ids in prompts(seed=6):
        assert (our_logits(model, ids) - hf_logits(hf_model, ids)).abs().max().item() <= 1e-4


def _llamacpp_rope_factors(head_dim: int, theta: float, scaling: dict) -> np.ndarray:
    """llama.cpp's LlamaModel.generate_extra_tensors for llama3 rope (per-frequency divisors)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_ctx = scaling["original_max_position_embeddings"]
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def test_llama3_rope_freqs_tensor(tmp_path):
    hf_model = tiny_hf_model("llama", seed=7)
    rope = hf_model.config.rope_parameters
    factors = _llamacpp_rope_factors(16, rope["rope_theta"], rope)
    path = tmp_path / "llama3.gguf"
    write_gguf(path, "llama", hf_model.config, _hf_weights(hf_model), QT.F32,
               extra_tensors={"rope_freqs.weight": factors})
    source = resolve_model(str(path))
    assert source.config.rope_scaling["rope_type"] == "freq_factors"
    model = load_model(source, torch.float32)
    ids = prompts(seed=8)[-1]  # 40 tokens: past the original context of 16
    assert (our_logits(model, ids) - hf_logits(hf_model, ids)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K], ids=lambda q: q.name)
def test_k_quant_dequantization_matches_independent_decoder(qtype):
    rng = np.random.default_rng(9)
    data, decoded = random_k_quant(3, 512, qtype, rng)
    ours = dequantize_tensor(data, qtype)
    assert ours.shape == (3, 512) and ours.dtype == torch.float32
    assert np.allclose(ours.numpy(), decoded, rtol=1e-6, atol=1e-7)


def test_k_quant_gguf_model_matches_reference(tmp_path):
    """A Q4_K_M-like file: ffn and embedding in K-quants (random blocks), q/k in F32."""
    hf_model = tiny_hf_model("llama", seed=10, hidden_size=256, intermediate_size=256,
                             num_attention_heads=4, head_dim=64)
    weights = _hf_weights(hf_model)
    rng = np.random.default_rng(11)
    raw, reference = {}, dict(weights)
    for name, w in weights.items():
        if w.ndim != 2 or name.endswith(("q_proj.weight", "k_proj.weight")):
            continue
        qtype = QT.Q6_K if name.endswith(("down_proj.weight", "embed_tokens.weight")) else QT.Q4_K
        data, decoded = random_k_quant(w.shape[0], w.shape[1], qtype, rng)  # independent decoder
        raw[name], reference[name] = (data, qtype), decoded
    assert len(raw) >= 5
    path = tmp_path / "tiny-Q4_K_M.gguf"
    rope = hf_model.config.rope_parameters  # llama3 scaling, stored the llama.cpp way
    factors = _llamacpp_rope_factors(64, rope["rope_theta"], rope)
    write_gguf(path, "llama", hf_model.config, weights, QT.F32, raw_tensors=raw,
               extra_tensors={"rope_freqs.weight": factors})
    _set_hf_weights(hf_model, reference)
    model = load_model(resolve_model(str(path)), torch.float32)
    for ids in prompts(seed=12):
        assert (our_logits(model, ids) - hf_logits(hf_model, ids)).abs().max().item() <= 1e-4


def test_truncated_gguf_is_a_clear_error(tmp_path):
    hf_model = tiny_hf_model("llama_tied", seed=13)
    path = tmp_path / "full.gguf"
    write_gguf(path, "llama", hf_model.config, _hf_weights(hf_model), QT.F32)
    data = path.read_bytes()
    for cut in (100, len(data) - 1000):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ValueError, match="cannot read GGUF"):
            resolve_model(str(bad))


# ---- the embedded default model -------------------------------------------------------------
# `hf_reference` (tests/conftest.py) is transformers' own GGUF load of the same file; only its
# `.model` and `.tokenizer` are used here.

QUESTION = "What is the capital of France?"


def _chat_ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                        add_generation_prompt=True, tokenize=True)
    return list(ids) if isinstance(ids, list) else list(ids["input_ids"])


@pytest.mark.slow
def test_default_model_matches_transformers_gguf(default_model_source, default_model_fp32, hf_reference):
    source = default_model_source
    assert source.name == "SmolLM2-135M-Instruct" and source.path.endswith(".gguf")
    assert source.config.architecture == "llama" and source.config.tie_word_embeddings
    chat = _chat_ids(hf_reference.tokenizer, QUESTION)
    plain = hf_reference.tokenizer("The quick brown fox jumps over the lazy").input_ids
    for ids in (chat, plain):
        ours = our_logits(default_model_fp32, ids)
        ref = hf_logits(hf_reference.model, ids)
        assert (ours - ref).abs().max().item() <= 1e-3
        assert ours[-1].argmax().item() == ref[-1].argmax().item()


@pytest.mark.slow
def test_default_tokenizer_has_chat_template(default_model_source, hf_reference):
    tokenizer = default_model_source.load_tokenizer()
    assert tokenizer.chat_template
    ids = _chat_ids(tokenizer, QUESTION)
    assert ids == _chat_ids(hf_reference.tokenizer, QUESTION)
    for text in ("Hello world!", " leading space, ünïcödé 🙂 1234", "<|im_start|>user\nhi<|im_end|>"):
        assert tokenizer(text).input_ids == hf_reference.tokenizer(text).input_ids
    assert tokenizer.eos_token_id in default_model_source.config.eos_token_ids
    assert tokenizer.decode(ids).rstrip().endswith("<|im_start|>assistant")


@pytest.mark.slow
def test_gguf_file_parses_like_gguf_reader(default_model_source):
    """Our lean header parser agrees with the gguf package's reader on the real file."""
    from gguf import GGUFReader

    from deepinfer.runtime.gguf_file import GGUFArrayInfo, GGUFFile

    reader, ours = GGUFReader(default_model_source.path), GGUFFile(default_model_source.path)
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = ours.metadata[key]
        if isinstance(value, GGUFArrayInfo):
            assert value.length == len(field.data), key
        else:
            assert value == field.contents(), key
    assert [t.name for t in reader.tensors] == [t.name for t in ours.tensors]
    for theirs, mine in zip(reader.tensors, ours.tensors):
        assert tuple(reversed(theirs.shape.tolist())) == mine.shape and theirs.tensor_type == mine.tensor_type
        assert np.array_equal(theirs.data, mine.data), mine.name
