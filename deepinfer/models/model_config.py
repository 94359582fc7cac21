"""Architecture hyper-parameters of a decoder-only model: dense Llama family, MoE (Mixtral,
Qwen3-MoE) and DeepSeek-V2/V3 (MoE + multi-head latent attention).

Pure (stdlib only) so the cost model and simulator can read parameter counts and KV sizes
without torch. Built from a Hugging Face `config.json` dict or from GGUF metadata
(`deepinfer.runtime.gguf_loader`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from deepinfer.models.mla_config import MLAConfig, mla_config_from_hf
from deepinfer.moe.moe_config import MoEConfig, moe_config_from_hf
from deepinfer.quant.quant_config import Fp8BlockQuantConfig, quant_config_from_hf

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "deepseek_v2",
                           "deepseek_v3")

# HF `architectures` entries -> our architecture name.
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}

# HF vision-language `architectures` whose `text_config` is one of the decoders above.
VISION_LANGUAGE_ARCHITECTURES = ("LlavaForConditionalGeneration", "Idefics3ForConditionalGeneration")


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters the model, KV cache and cost model need.

    `rope_scaling` follows HF (`{"rope_type": "llama3", "factor": ..., ...}`); `None` is plain
    RoPE. `sliding_window` is recorded (Mistral v0.1) but attention backends may ignore it
    for contexts shorter than the window.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None = None
    moe: MoEConfig | None = None  # MoE routing and which layers are sparse; None = dense
    mla: MLAConfig | None = None  # DeepSeek latent attention; None = MHA/GQA
    # A vision-language checkpoint's whole HF config (its text_config is what the fields above
    # describe); None for a text-only model.
    vision_language: dict[str, Any] | None = None
    # How the checkpoint stores its weights (block-scaled FP8); None: unquantized.
    quantization: Fp8BlockQuantConfig | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Build from a parsed HF `config.json`. Raises ValueError for other architectures."""
        if any(a in VISION_LANGUAGE_ARCHITECTURES for a in cfg.get("architectures") or ()):
            text = dict(cfg.get("text_config") or {})
            if cfg.get("eos_token_id") is not None:  # merged from generation_config.json
                text["eos_token_id"] = cfg["eos_token_id"]
            return dataclasses.replace(cls.from_hf_config(text), vision_language=dict(cfg))
        arch = _architecture_of(cfg)
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // num_heads
        rope_theta = cfg.get("rope_theta")
        rope_scaling = cfg.get("rope_scaling")
        rope_params = cfg.get("rope_parameters")  # transformers >= 5 folds both in here
        if isinstance(rope_params, dict):
            rope_theta = rope_theta or rope_params.get("rope_theta")
            if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
                rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        if isinstance(rope_scaling, dict):
            rope_scaling = dict(rope_scaling)
            if "type" in rope_scaling and "rope_type" not in rope_scaling:
                rope_scaling["rope_type"] = rope_scaling.pop("type")
            if rope_scaling.get("rope_type", "default") == "default":
                rope_scaling = None
        if cfg.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported")
        quantization = quant_config_from_hf(cfg.get("quantization_config"))
        eos = cfg.get("eos_token_id")
        eos_list = eos if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos])
        eos_ids = tuple(dict.fromkeys(int(e) for e in eos_list))
        use_sw = cfg.get("use_sliding_window", arch in ("mistral", "mixtral"))
        num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
        mla = None
        if arch in ("deepseek_v2", "deepseek_v3"):
            mla = mla_config_from_hf(cfg, rope_scaling)
            # MLA has no K/V heads of its own: expanded keys have one per query head.
            head_dim, num_kv_heads = mla.qk_head_dim, num_heads
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases (its config has no flag); Llama/Qwen3 use the flag.
            attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch in ("qwen3", "qwen3_moe"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=cfg.get("sliding_window") if use_sw else None,
            moe=moe_config_from_hf(arch, cfg),
            mla=mla,
            quantization=quantization,
        )

    # ---- sizes for the cost model and the KV cache ---------------------------------------

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def o_proj_bias(self) -> bool:
        """HF Llama/Qwen3 put `attention_bias` on o_proj too; Qwen2 biases only q/k/v."""
        return self.attention_bias and self.architecture != "qwen2"

    def num_layer_params(self, layer_idx: int = 0) -> int:
        """Parameters of one decoder layer (projections, biases, norms, all experts)."""
        return self._attention_params() + self._mlp_params(layer_idx, active=False) + 2 * self.hidden_size

    def _attention_params(self) -> int:
        if self.mla is not None:
            return self._mla_params()
        attn = self.hidden_size * (self.q_size + 2 * self.kv_size) + self.q_size * self.hidden_size
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.o_proj_bias:
            attn += self.hidden_size
        if self.qk_norm:
            attn += 2 * self.head_dim
        return attn

    def _mla_params(self) -> int:
        m, h, heads = self.mla, self.hidden_size, self.num_attention_heads
        bias = self.attention_bias
        if m.q_lora_rank is None:
            q = h * heads * m.qk_head_dim
        else:
            q = h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * heads * m.qk_head_dim
            q += m.q_lora_rank if bias else 0
        kv = h * m.cache_entry_dim + m.kv_lora_rank + m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
        kv += m.cache_entry_dim if bias else 0
        o = heads * m.v_head_dim * h + (h if bias else 0)
        return q + kv + o

    def _mlp_params(self, layer_idx: int, active: bool) -> int:
        """MLP weights of a layer; `active`: only what one token multiplies (top-k experts)."""
        h, moe = self.hidden_size, self.moe
        if moe is None or not moe.is_moe_layer(layer_idx):
            return 3 * h * self.intermediate_size
        num_routed = moe.num_experts_per_tok if active else moe.num_experts
        params = moe.num_experts * h  # router
        params += num_routed * 3 * h * moe.moe_intermediate_size
        params += 3 * h * moe.shared_intermediate_size
        if moe.use_correction_bias and not active:
            params += moe.num_experts
        return params

    def num_params(self) -> int:
        """Total distinct parameters (a tied lm_head counted once)."""
        embed = self.vocab_size * self.hidden_size
        lm_head = 0 if self.tie_word_embeddings else embed
        layers = sum(self.num_layer_params(i) for i in range(self.num_hidden_layers))
        return embed + lm_head + layers + self.hidden_size

    def num_active_params(self) -> int:
        """Weights multiplied per token in the decoder layers (2 FLOPs each per token).

        Excludes the embedding lookup (no matmul) and the lm_head, which only runs on the
        positions that are sampled; see `num_lm_head_params`. MoE layers count the router,
        the top-k routed experts and the shared experts."""
        per_layer = self._attention_params() + 2 * self.hidden_size
        return sum(per_layer + self._mlp_params(i, active=True) for i in range(self.num_hidden_layers))

    def num_lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of KV cache one token occupies across all layers (MLA: latent + rope key)."""
        if self.mla is not None:
            return self.num_hidden_layers * self.mla.cache_entry_dim * dtype_bytes
        return 2 * self.num_hidden_layers * self.kv_size * dtype_bytes

    def num_expert_params(self) -> int:
        """Parameters of one routed expert summed over the MoE layers (0 for dense models)."""
        if self.moe is None:
            return 0
        num_moe_layers = sum(self.moe.is_moe_layer(i) for i in range(self.num_hidden_layers))
        return num_moe_layers * 3 * self.hidden_size * self.moe.moe_intermediate_size


def _architecture_of(cfg: dict[str, Any]) -> str:
    for name in cfg.get("architectures") or ():
        if name in HF_ARCHITECTURES:
            return HF_ARCHITECTURES[name]
    model_type = cfg.get("model_type")
    if model_type in SUPPORTED_ARCHITECTURES:
        return model_type
    raise ValueError(
        f"unsupported model: architectures={cfg.get('architectures')!r}, "
        f"model_type={model_type!r}; supported: {', '.join(sorted(HF_ARCHITECTURES))}"
    )
