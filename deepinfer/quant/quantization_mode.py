"""Which weight format a model is loaded in: the `--quantization` flag (vLLM's name).

    None (default)  the checkpoint's own: a GGUF file's block-quantized matrices computed
                    natively on CPU ("gguf"); anything else as today ("none")
    "none", "bf16"  every weight expanded to the model dtype, as before quantized kernels
    "gguf"          a GGUF file's quantized matrices kept in their blocks (an error for other
                    checkpoints)
    "int8"          bf16 / float32 weights quantized at load to int8 per output channel, with
                    activations quantized per token at run time (W8A8)
"""
from __future__ import annotations

QUANTIZATION_CHOICES = ("none", "bf16", "gguf", "int8")


def resolve_quantization(requested: str | None, *, is_gguf: bool, has_quantized: bool,
                         device_type: str) -> str:
    """The mode to load with: "none", "gguf" or "int8". ValueError for an unknown or
    impossible request."""
    if requested is None:
        return "gguf" if is_gguf and has_quantized and device_type == "cpu" else "none"
    mode = requested.strip().lower()
    if mode not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, "
                         f"got {requested!r}")
    if mode == "bf16":
        return "none"
    if mode == "gguf" and not is_gguf:
        raise ValueError("--quantization gguf needs a .gguf model file")
    return mode
