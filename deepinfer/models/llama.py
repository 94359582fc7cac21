"""Llama-family decoder: Llama 2/3, SmolLM2, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k norm), and
with a sparse MoE MLP (`build_mlp`) Mixtral and Qwen3-MoE.

Module names follow Hugging Face so checkpoint names map one-to-one, except two fusions that
save matmuls on the hot path:

    q_proj | k_proj | v_proj  ->  self_attn.qkv_proj   rows [q (H*d) | k (KV*d) | v (KV*d)]
    gate_proj | up_proj       ->  mlp.gate_up_proj     rows [gate (I) | up (I)]

The forward takes a flat token batch; which tokens belong to which sequence (and the KV
cache) is the `AttentionBackend`'s business.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deepinfer.layers.attention import AttentionBackend
from deepinfer.layers.empty_init import uninitialized
from deepinfer.layers.mlp import SwiGLUMLP
from deepinfer.layers.norm import RMSNorm
from deepinfer.layers.rotary import RotaryEmbedding, apply_rotary
from deepinfer.models.model_config import ModelConfig
from deepinfer.models.weight_mapping import load_hf_named_weights
from deepinfer.quant.quantized_linear import QuantizedLinear


# Per row, how many of the largest low-precision logits compute_logits recomputes in fp32.
NUM_EXACT_LOGITS = 8


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.qkv_proj = uninitialized(
            nn.Linear, config.hidden_size, self.q_size + 2 * self.kv_size,
            bias=config.attention_bias, dtype=dtype,
        )
        self.o_proj = uninitialized(nn.Linear, self.q_size, config.hidden_size, bias=config.o_proj_bias, dtype=dtype)
        if config.qk_norm:  # Qwen3: RMSNorm over head_dim of each q and k head, before RoPE
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None
        self.cpu_kernels = None  # set by runtime.cpu_elementwise_kernels on bf16 CPU models

    def _rotary(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        kernels = self.cpu_kernels
        if kernels is not None and kernels.rotary_applies(x, cos, sin):
            return kernels.rotary(x, cos, sin)  # one pass, the same bf16 roundings
        return apply_rotary(x, cos, sin)

    def forward(self, cos: Tensor, sin: Tensor, hidden: Tensor, attn: AttentionBackend) -> Tensor:
        qkv = self.qkv_proj(hidden)  # [T, (H + 2*KV) * d]
        num_tokens, num_qk_heads = qkv.shape[0], self.num_heads + self.num_kv_heads
        v = qkv[:, self.q_size + self.kv_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is None:
            # q and k are adjacent in each row: rotate them as one [T, H + KV, d] view.
            qk = qkv[:, :self.q_size + self.kv_size].view(num_tokens, num_qk_heads, self.head_dim)
            qk = self._rotary(qk, cos, sin)
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]  # [T, H, d], [T, KV, d]
        else:
            q = qkv[:, :self.q_size].view(num_tokens, self.num_heads, self.head_dim)
            k = qkv[:, self.q_size:self.q_size + self.kv_size].view(num_tokens, self.num_kv_heads, self.head_dim)
            q = self._rotary(self.q_norm(q), cos, sin)
            k = self._rotary(self.k_norm(k), cos, sin)
        out = attn.forward(self.layer_idx, q, k, v)  # [T, H, d]
        return self.o_proj(out.reshape(-1, self.q_size))


def build_mlp(config: ModelConfig, layer_idx: int, dtype: torch.dtype) -> nn.Module:
    """The layer's feed-forward: dense SwiGLU, or a sparse MoE block (Mixtral, Qwen3-MoE,
    DeepSeek-V3) on the layers its MoE config marks sparse."""
    if config.moe is not None and config.moe.is_moe_layer(layer_idx):
        from deepinfer.moe.layer import SparseMoEBlock
        return SparseMoEBlock(config.moe, config.hidden_size, dtype)
    return SwiGLUMLP(config.hidden_size, config.intermediate_size, dtype)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(config, layer_idx, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = build_mlp(config, layer_idx, dtype)

    def forward(self, cos: Tensor, sin: Tensor, hidden: Tensor, attn: AttentionBackend) -> Tensor:
        hidden = hidden + self.self_attn(cos, sin, self.input_layernorm(hidden), attn)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = uninitialized(nn.Embedding, config.vocab_size, config.hidden_size, dtype=dtype)
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling, dtype
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, dtype) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        # The whole stack in one C call for decode-only steps of a few rows; set by
        # runtime.cpu_decode_stack on bf16 CPU dense models.
        self.decode_stack = None

    def forward(self, input_ids: Tensor, positions: Tensor, attn: AttentionBackend,
                input_embeds: Tensor | None = None) -> Tensor:
        stack = self.decode_stack
        if stack is not None and input_embeds is None and stack.applies(input_ids, attn):
            return stack(input_ids, positions, attn)
        hidden = self.embed_tokens(input_ids) if input_embeds is None else input_embeds  # [T, hidden]
        cos, sin = self.rotary.cos_sin(positions)  # [T, 1, d/2] each, shared by all layers
        for layer in self.layers:
            hidden = layer(cos, sin, hidden, attn)
        return self.norm(hidden)


class LlamaForCausalLM(nn.Module):
    """Dense Llama-family causal LM over flat token batches.

    Weights are uninitialised until `load_weights` fills every parameter."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.model = LlamaModel(config, dtype)
        self._init_lm_head(config, dtype)
        self.requires_grad_(False)

    def _init_lm_head(self, config: ModelConfig, dtype: torch.dtype) -> None:
        if config.tie_word_embeddings:
            self.lm_head = None  # logits use embed_tokens.weight
        else:
            self.lm_head = uninitialized(nn.Linear, config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        # The plain head, kept outside the module tree: weight packing may replace `lm_head`
        # with a module that has no `.weight`, and the exact top-k recompute needs it.
        self._plain_lm_head = (self.lm_head,)
        # An optional faster module computing hidden @ weight.T (runtime.cpu_linear_packing).
        self.logits_linear: nn.Module | None = None

    @torch.inference_mode()
    def forward(self, input_ids: Tensor, positions: Tensor, attn: AttentionBackend,
                input_embeds: Tensor | None = None) -> Tensor:
        """input_ids/positions [T] (tokens of any number of sequences) -> hidden [T, hidden].
        `input_embeds` [T, hidden] replaces the token embeddings (image rows spliced in)."""
        return self.model(input_ids, positions, attn, input_embeds)

    @torch.inference_mode()
    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden [N, hidden] -> logits [N, vocab] in float32.

        In bf16/fp16 the matmul accumulates in fp32 but rounds its output to the model dtype
        (bf16 steps are 0.125 near a logit of 25), which turns close top tokens into exact
        ties. The top `NUM_EXACT_LOGITS` of each row are therefore recomputed in fp32 from
        the same weights: greedy picks and top probabilities are exact, the tail stays rounded.
        A packed head whose small-batch kernel takes the rows (CPU, <= 8 rows) gives fp32
        logits directly (its dots are fp32 before any rounding): no rounding, no recompute;
        so does a quantized head (its kernel's dots are fp32) for any number of rows.
        """
        head = self.logits_linear if self.logits_linear is not None else self.lm_head
        if isinstance(head, QuantizedLinear):  # float32 dots straight from the kernel
            return head.logits_f32(hidden)
        logits_f32 = getattr(head, "logits_f32", None)
        if logits_f32 is not None and hidden.dtype == torch.bfloat16 and hidden.shape[0] > 0:
            logits = logits_f32(hidden)
            if logits is not None:
                return logits
        weight = self.model.embed_tokens.weight if self.lm_head is None else self._plain_lm_head[0].weight
        if self.logits_linear is not None:
            logits = self.logits_linear(hidden).float()  # [N, vocab]
        elif self.lm_head is not None:
            logits = self.lm_head(hidden).float()  # [N, vocab] (maybe a packed module)
        else:
            logits = F.linear(hidden, weight).float()  # [N, vocab]
        if hidden.dtype == torch.float32 or hidden.shape[0] == 0:
            return logits
        k = min(NUM_EXACT_LOGITS, logits.shape[-1])
        top_ids = logits.topk(k, dim=-1).indices  # [N, k]
        top_weights = weight.index_select(0, top_ids.flatten()).view(*top_ids.shape, -1).float()  # [N, k, hidden]
        exact = torch.bmm(top_weights, hidden.float().unsqueeze(-1)).squeeze(-1)  # [N, k]
        return logits.scatter_(1, top_ids, exact)

    def logits_weight(self) -> Tensor | None:
        """The head's plain [vocab, hidden] weight (the embeddings when tied), or None."""
        head = self.model.embed_tokens if self.lm_head is None else self._plain_lm_head[0]
        return getattr(head, "weight", None)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Copy HF-named tensors into the (fused) parameters, casting to the model dtype.

        Raises ValueError on unexpected names, wrong shapes, or parameters left unfilled."""
        load_hf_named_weights(self, weights)
