"""Which weight format a model is loaded in: the `--quantization` flag (vLLM's name).

    None (default)  the checkpoint's own: a GGUF file's block-quantized matrices computed
                    natively on CPU ("gguf"); anything else as today ("none")
    "none", "bf16"  every weight expanded to the model dtype, as before quantized kernels
    "gguf"          a GGUF file's quantized matrices kept in their blocks (an error for other
                    checkpoints)
    "int8"          bf16 / float32 weights quantized at load to int8 per output channel, with
                    activations quantized per token at run time (W8A8)
    "fp8"           a block-scaled FP8 checkpoint's weights kept in FP8 (its default; the only
                    format such a checkpoint loads in; an error for other checkpoints)
"""
from __future__ import annotations

QUANTIZATION_CHOICES = ("none", "bf16", "gguf", "int8", "fp8")


def resolve_quantization(requested: str | None, *, is_gguf: bool, has_quantized: bool,
                         device_type: str, is_fp8: bool = False) -> str:
    """The mode to load with: "none", "gguf", "int8" or "fp8". ValueError for an unknown or
    impossible request."""
    if requested is None:
        if is_fp8:
            return "fp8"
        return "gguf" if is_gguf and has_quantized and device_type == "cpu" else "none"
    mode = requested.strip().lower()
    if mode not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, "
                         f"got {requested!r}")
    if is_fp8 != (mode == "fp8"):
        raise ValueError("--quantization fp8 needs a block-scaled FP8 checkpoint" if not is_fp8
                         else f"--quantization {mode}: an FP8 checkpoint loads in its own FP8 "
                              "format only (omit the flag or pass fp8)")
    if mode == "bf16":
        return "none"
    if mode == "gguf" and not is_gguf:
        raise ValueError("--quantization gguf needs a .gguf model file")
    return mode
