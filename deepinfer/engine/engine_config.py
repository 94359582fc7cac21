"""Engine configuration: plain data, validated on construction, no IO."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deepinfer.sampling_params import LOGPROBS_MODES

_DTYPES = ("bfloat16", "float32", "float16")
_SCHEDULERS = ("token-budget", "compute-aware")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct GGUF
    dtype: str = "bfloat16"
    device: str = "auto"  # "auto" picks cuda when available, else cpu
    kv_cache_memory: str | int = "4GiB"
    num_kv_blocks: int | None = None  # overrides kv_cache_memory (tests, tiny caches)
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max positions
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    num_threads: int | None = None  # CPU intra-op threads; None: all cores
    scheduler: str = "token-budget"
    step_time_budget_ms: float | None = None
    cost_profile: str | None = None
    seed: int = 0
    served_model_name: str | None = None
    # deepinfer.spec.spec_config.SpeculativeConfig, or its dict / JSON form (vLLM's shape)
    speculative_config: Any = None
    logprobs_mode: str = LOGPROBS_MODES[0]  # what logprobs report (vLLM's --logprobs-mode)
    # weight format (vLLM's --quantization): None = the checkpoint's own (GGUF blocks computed
    # natively on CPU); "none"/"bf16" expand; "gguf"; "int8" (W8A8) -- quant/quantization_mode.py
    quantization: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.scheduler not in _SCHEDULERS:
            raise ValueError(f"scheduler must be one of {_SCHEDULERS}, got {self.scheduler!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError("num_kv_blocks must be at least 2")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError("num_threads must be positive")
        if self.step_time_budget_ms is not None and self.step_time_budget_ms <= 0:
            raise ValueError("step_time_budget_ms must be positive")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, "
                             f"got {self.logprobs_mode!r}")
        if self.quantization is not None:
            from deepinfer.quant.quantization_mode import QUANTIZATION_CHOICES
            if self.quantization not in QUANTIZATION_CHOICES:
                raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, "
                                 f"got {self.quantization!r}")
        from deepinfer.spec.spec_config import SpeculativeConfig
        object.__setattr__(self, "speculative_config",
                           SpeculativeConfig.parse(self.speculative_config))
