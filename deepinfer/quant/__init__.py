"""Quantized weight formats (GGUF block quants, FP8 block-scaled, int8): the data-only weight
contract, reference dequantization, and the linear / embedding modules that compute with them."""
