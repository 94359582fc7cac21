"""DeepSeek-V3: multi-head latent attention (MLA) + sparse MoE with grouped sigmoid routing.

Module names follow Hugging Face (`q_a_proj`, `kv_a_proj_with_mqa`, `kv_b_proj`, `mlp.gate`,
`mlp.experts`, `mlp.shared_experts`) so checkpoint names map one-to-one; only the MLP halves
and the experts are fused / stacked (see `weight_mapping`). The first `first_k_dense_replace`
layers have a dense MLP. Attention goes through an `MLAAttentionBackend`; the model hands it
the latent and the rope key, never per-head K/V.
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

from deepinfer.layers.empty_init import uninitialized
from deepinfer.layers.mla import MLAAttentionBackend, MLAWeights
from deepinfer.layers.norm import RMSNorm
from deepinfer.layers.rotary import RotaryEmbedding, apply_rotary, apply_rotary_interleaved
from deepinfer.models.llama import LlamaForCausalLM, build_mlp
from deepinfer.models.model_config import ModelConfig


class ProjectionWeight(nn.Module):
    """A bare [out, in] weight. Not an nn.Linear on purpose: the absorbed decode reads it as
    per-head blocks, so weight packing (runtime.cpu_linear_packing) must leave it alone."""

    def __init__(self, out_features: int, in_features: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)


@functools.cache
def _native_bf16_matmul() -> bool:
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _float32_up_projections(weight: Tensor) -> bool:
    return weight.dtype == torch.bfloat16 and weight.device.type == "cpu" \
        and not _native_bf16_matmul()


class DeepseekV3Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype):
        super().__init__()
        mla = config.mla
        self.mla = mla
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        hidden, heads, bias = config.hidden_size, self.num_heads, config.attention_bias
        if mla.q_lora_rank is None:
            self.q_proj = uninitialized(nn.Linear, hidden, heads * mla.qk_head_dim, bias=False, dtype=dtype)
        else:
            self.q_a_proj = uninitialized(nn.Linear, hidden, mla.q_lora_rank, bias=bias, dtype=dtype)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, config.rms_norm_eps, dtype)
            self.q_b_proj = uninitialized(nn.Linear, mla.q_lora_rank, heads * mla.qk_head_dim, bias=False, dtype=dtype)
        self.kv_a_proj_with_mqa = uninitialized(nn.Linear, hidden, mla.cache_entry_dim, bias=bias, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, config.rms_norm_eps, dtype)
        self.kv_b_proj = ProjectionWeight(heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank, dtype)
        self.o_proj = uninitialized(nn.Linear, heads * mla.v_head_dim, hidden, bias=bias, dtype=dtype)
        self._float32_kv_b = None  # ((data_ptr, version) of kv_b_proj.weight, its float32 copy)
        self.rotate = apply_rotary_interleaved if mla.rope_interleave else apply_rotary

    def latent_weights(self) -> MLAWeights:
        m = self.mla
        w = self.kv_b_proj.weight
        if _float32_up_projections(w):  # layers/mla.py: bf16 matmuls are slow on this CPU
            cached = self._float32_kv_b
            if cached is None or cached[0] != (w.data_ptr(), w._version):
                self._float32_kv_b = cached = ((w.data_ptr(), w._version), w.float())
            w = cached[1]
        w = w.view(self.num_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        return MLAWeights(w[:, :m.qk_nope_head_dim], w[:, m.qk_nope_head_dim:], m.softmax_scale)

    def forward(self, cos: Tensor, sin: Tensor, hidden: Tensor, attn: MLAAttentionBackend) -> Tensor:
        m, num_tokens = self.mla, hidden.shape[0]
        if m.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q = q.view(num_tokens, self.num_heads, m.qk_head_dim)
        q_nope, q_pe = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(hidden).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())  # [T, r]
        q_pe = self.rotate(q_pe, cos, sin)  # [T, H, rope]
        k_pe = self.rotate(k_pe.unsqueeze(1), cos, sin).squeeze(1)  # [T, rope]
        out = attn.forward_mla(self.layer_idx, q_nope, q_pe, latent, k_pe, self.latent_weights())
        return self.o_proj(out.reshape(num_tokens, -1))  # [T, H * v] -> [T, hidden]


class DeepseekV3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = DeepseekV3Attention(config, layer_idx, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = build_mlp(config, layer_idx, dtype)

    def forward(self, cos: Tensor, sin: Tensor, hidden: Tensor, attn: MLAAttentionBackend) -> Tensor:
        hidden = hidden + self.self_attn(cos, sin, self.input_layernorm(hidden), attn)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DeepseekV3Model(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = uninitialized(nn.Embedding, config.vocab_size, config.hidden_size, dtype=dtype)
        self.rotary = RotaryEmbedding(config.mla.qk_rope_head_dim, config.max_position_embeddings,
                                      config.rope_theta, config.rope_scaling, dtype)
        self.layers = nn.ModuleList(
            DeepseekV3DecoderLayer(config, i, dtype) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, input_ids: Tensor, positions: Tensor, attn: MLAAttentionBackend,
                input_embeds: Tensor | None = None) -> Tensor:
        # The shared causal-LM wrapper passes input_embeds (None for text-only models).
        hidden = self.embed_tokens(input_ids) if input_embeds is None else input_embeds  # [T, hidden]
        cos, sin = self.rotary.cos_sin(positions)  # [T, 1, rope/2]
        for layer in self.layers:
            hidden = layer(cos, sin, hidden, attn)
        return self.norm(hidden)


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    """DeepSeek-V3 causal LM over flat token batches; logits and loading as LlamaForCausalLM."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32):
        if config.mla is None or config.moe is None:
            raise ValueError("DeepseekV3ForCausalLM needs a config with MLA and MoE parameters")
        nn.Module.__init__(self)
        self.config = config
        self.dtype = dtype
        self.model = DeepseekV3Model(config, dtype)
        self._init_lm_head(config, dtype)
        self.requires_grad_(False)


class DeepseekV3MTPLayer(DeepseekV3DecoderLayer):
    """One multi-token-prediction module (DeepSeek-V3 §2.2): at position p it combines the
    previous depth's hidden state h_p with the embedding of token t_{p+1},

        h' = eh_proj([enorm(embed(t_{p+1})) ; hnorm(h_p)]),   then a full decoder block,

    and predicts t_{p+2} through `shared_head` (norm + head). Checkpoint names are the
    decoder layer's plus `enorm`, `hnorm`, `eh_proj`, `embed_tokens`, `shared_head.{norm,head}`
    under `model.layers.{num_hidden_layers + i}.`. Its attention uses layer 0 of its own cache.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__(config, config.num_hidden_layers, dtype)  # MoE / dense as that layer
        self.self_attn.layer_idx = 0
        hidden = config.hidden_size
        self.embed_tokens = uninitialized(nn.Embedding, config.vocab_size, hidden, dtype=dtype)
        self.enorm = RMSNorm(hidden, config.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(hidden, config.rms_norm_eps, dtype)
        self.eh_proj = uninitialized(nn.Linear, 2 * hidden, hidden, bias=False, dtype=dtype)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(hidden, config.rms_norm_eps, dtype)
        self.shared_head.head = uninitialized(nn.Linear, hidden, config.vocab_size, bias=False, dtype=dtype)


class DeepseekV3MTP(nn.Module):
    """The first MTP module of a DeepSeek-V3 checkpoint as a drafter model (a depth reused
    for every draft step, as vLLM does): forward(input_ids, positions, attn, prev_hidden)
    with input_ids[i] = t_{p+1} at positions[i] = p and prev_hidden[i] = h_p returns the
    module's output hidden states (the next step's prev_hidden); `compute_logits` applies
    the shared head."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.rotary = RotaryEmbedding(config.mla.qk_rope_head_dim, config.max_position_embeddings,
                                      config.rope_theta, config.rope_scaling, dtype)
        self.layers = nn.ModuleList([DeepseekV3MTPLayer(config, dtype)])
        self.requires_grad_(False)

    @torch.inference_mode()
    def forward(self, input_ids: Tensor, positions: Tensor, attn: MLAAttentionBackend,
                prev_hidden: Tensor) -> Tensor:
        layer = self.layers[0]
        cos, sin = self.rotary.cos_sin(positions)
        emb = layer.enorm(layer.embed_tokens(input_ids))  # [T, hidden]
        hidden = layer.eh_proj(torch.cat([emb, layer.hnorm(prev_hidden.to(emb.dtype))], dim=-1))
        return DeepseekV3DecoderLayer.forward(layer, cos, sin, hidden, attn)

    @torch.inference_mode()
    def compute_logits(self, hidden: Tensor) -> Tensor:
        head = self.layers[0].shared_head
        return head.head(head.norm(hidden)).float()  # [N, vocab]

    def load_weights(self, weights) -> None:
        """HF-named tensors of the checkpoint's MTP layer (`model.layers.{N}.*`, N =
        num_hidden_layers); other names are ignored."""
        from deepinfer.models.weight_mapping import load_hf_named_weights

        prefix = f"model.layers.{self.config.num_hidden_layers}."
        load_hf_named_weights(self, ((f"layers.0.{name[len(prefix):]}", tensor)
                                     for name, tensor in weights if name.startswith(prefix)))


def iter_mtp_weights(checkpoint, num_hidden_layers: int):
    """(HF name, tensor) of the first MTP layer, reading only those tensors of the
    checkpoint's safetensors shards (the causal LM's loader skips them)."""
    from safetensors import safe_open

    prefix = f"model.layers.{num_hidden_layers}."
    for path in checkpoint.weight_files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if name.startswith(prefix):
                    yield name, f.get_tensor(name)
