"""Write tiny GGUF files the way llama.cpp's converter does, plus an independent K-quant decoder.

`write_gguf` takes HF-named fp32 weights, permutes q/k rows for llama-arch (llama.cpp's
`LlamaModel.permute`, re-implemented here from its definition) and stores 2-D matrices in the
requested quant type; 1-D tensors (norms, biases) stay F32 like llama.cpp.
"""
from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

_HF_TO_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_HF_TO_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def hf_to_gguf_name(name: str) -> str:
    if name in _HF_TO_GGUF_GLOBAL:
        return _HF_TO_GGUF_GLOBAL[name]
    _, _, layer, rest = name.split(".", 3)  # model.layers.N.rest
    return f"blk.{layer}.{_HF_TO_GGUF_LAYER[rest]}"


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.LlamaModel.permute (rows of one of q_proj / k_proj)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def encode_tensor(w: np.ndarray, qtype: QT) -> tuple[np.ndarray, QT]:
    """(data for GGUFWriter.add_tensor, raw dtype)."""
    if w.ndim == 1 or qtype == QT.F32:
        return w.astype(np.float32), QT.F32
    if qtype == QT.F16:
        return w.astype(np.float16), QT.F16
    return gguf.quants.quantize(w.astype(np.float32), qtype), qtype


def roundtrip(w: np.ndarray, qtype: QT) -> np.ndarray:
    """What a loader should read back for `w` stored as `qtype` (float32)."""
    data, raw = encode_tensor(w, qtype)
    if raw == QT.F32:
        return data
    if raw == QT.F16:
        return data.astype(np.float32)
    return gguf.quants.dequantize(data, raw)


def write_gguf(path, arch: str, hf_config, weights: dict[str, np.ndarray], qtype: QT,
               raw_tensors: dict[str, tuple[np.ndarray, QT]] | None = None,
               extra_tensors: dict[str, np.ndarray] | None = None) -> None:
    """Write `weights` (HF names, fp32) as a GGUF of `arch`.

    `raw_tensors`: HF name -> (already encoded bytes, type), stored as is (no permutation).
    `extra_tensors`: GGUF name -> fp32 array (e.g. rope_freqs.weight)."""
    c = hf_config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    writer.add_bos_token_id(c.bos_token_id)
    writer.add_eos_token_id(c.eos_token_id)
    for name, w in weights.items():
        if raw_tensors and name in raw_tensors:
            data, raw = raw_tensors[name]
            writer.add_tensor(hf_to_gguf_name(name), data, raw_dtype=raw)
            continue
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = c.num_attention_heads if ".q_proj." in name else c.num_key_value_heads
            w = llamacpp_permute(w, heads)
        data, raw = encode_tensor(w, qtype)
        writer.add_tensor(hf_to_gguf_name(name), data, raw_dtype=raw)
    for name, w in (extra_tensors or {}).items():
        writer.add_tensor(name, w.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# ---- independent K-quant decoders (from the block layouts in ggml-common.h) -----------------

def _f16(b: np.ndarray) -> np.ndarray:
    return b.copy().view(np.float16).astype(np.float32)


def decode_q4_k(blocks: np.ndarray) -> np.ndarray:
    """blocks [n, 144] uint8 -> [n, 256]: d, dmin (f16), 12 bytes of 6-bit scales/mins, 128 nibbles."""
    out = np.empty((blocks.shape[0], 256), dtype=np.float32)
    for i, b in enumerate(blocks):
        d, dmin = _f16(b[0:2])[0], _f16(b[2:4])[0]
        sc_bytes, qs = b[4:16].astype(np.int32), b[16:144].astype(np.int32)
        scales, mins = [], []
        for j in range(8):
            if j < 4:
                scales.append(sc_bytes[j] & 63)
                mins.append(sc_bytes[j + 4] & 63)
            else:
                scales.append((sc_bytes[j + 4] & 0xF) | ((sc_bytes[j - 4] >> 6) << 4))
                mins.append((sc_bytes[j + 4] >> 4) | ((sc_bytes[j] >> 6) << 4))
        for chunk in range(4):  # 64 values: low nibbles (sub-block 2c) then high (2c+1)
            q = qs[32 * chunk: 32 * chunk + 32]
            lo, hi = 2 * chunk, 2 * chunk + 1
            out[i, 64 * chunk: 64 * chunk + 32] = d * scales[lo] * (q & 0xF) - dmin * mins[lo]
            out[i, 64 * chunk + 32: 64 * chunk + 64] = d * scales[hi] * (q >> 4) - dmin * mins[hi]
    return out


def decode_q6_k(blocks: np.ndarray) -> np.ndarray:
    """blocks [n, 210] uint8 -> [n, 256]: ql[128], qh[64], int8 scales[16], d (f16)."""
    out = np.empty((blocks.shape[0], 256), dtype=np.float32)
    for i, b in enumerate(blocks):
        ql, qh = b[0:128].astype(np.int32), b[128:192].astype(np.int32)
        sc = b[192:208].copy().view(np.int8).astype(np.float32)
        d = _f16(b[208:210])[0]
        for half in range(2):
            l_ql, l_qh, s = ql[64 * half:64 * half + 64], qh[32 * half:32 * half + 32], sc[8 * half:8 * half + 8]
            base = 128 * half
            for l in range(32):
                k = l // 16
                q1 = ((l_ql[l] & 0xF) | ((l_qh[l] & 3) << 4)) - 32
                q2 = ((l_ql[l + 32] & 0xF) | (((l_qh[l] >> 2) & 3) << 4)) - 32
                q3 = ((l_ql[l] >> 4) | (((l_qh[l] >> 4) & 3) << 4)) - 32
                q4 = ((l_ql[l + 32] >> 4) | (((l_qh[l] >> 6) & 3) << 4)) - 32
                out[i, base + l] = d * s[k] * q1
                out[i, base + l + 32] = d * s[k + 2] * q2
                out[i, base + l + 64] = d * s[k + 4] * q3
                out[i, base + l + 96] = d * s[k + 6] * q4
    return out


def random_k_quant(rows: int, cols: int, qtype: QT, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Random valid blocks for a [rows, cols] tensor -> (bytes [rows, cols/256*size], decoded fp32)."""
    assert cols % 256 == 0
    n = rows * cols // 256
    if qtype == QT.Q4_K:
        blocks = rng.integers(0, 256, (n, 144), dtype=np.uint8)
        blocks[:, 0:2] = (rng.uniform(2e-4, 4e-4, n).astype(np.float16)).view(np.uint8).reshape(n, 2)
        blocks[:, 2:4] = (rng.uniform(1e-4, 3e-4, n).astype(np.float16)).view(np.uint8).reshape(n, 2)
        decoded = decode_q4_k(blocks)
    elif qtype == QT.Q6_K:
        blocks = rng.integers(0, 256, (n, 210), dtype=np.uint8)
        blocks[:, 208:210] = (rng.uniform(4e-5, 8e-5, n).astype(np.float16)).view(np.uint8).reshape(n, 2)
        decoded = decode_q6_k(blocks)
    else:
        raise ValueError(qtype)
    return blocks.reshape(rows, -1), decoded.reshape(rows, cols)
