"""The Python side of the decode stack's weight interface (kernels/stack_weights.h): one
descriptor table per weight slot, whatever the format.

    slot_descriptors(linear) -> int64 [STACK_PARTS, 8]   (a part per row block; rows = 0: none)

A bf16 slot is its plain weight (nn.Linear's, or the copy a PackedLinear keeps for the small-
batch GEMV); a quantized slot is each `QuantizedWeight` part of a `QuantizedLinear` (any
format of the contract). An MoE expert's slot is a descriptor of its [out, in] row slice
(`QuantizedWeight.narrow_rows`), no copy.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from deepinfer.quant.quantized_linear import QuantizedEmbedding, QuantizedLinear
from deepinfer.quant.quantized_weight import QuantizedWeight
from deepinfer.runtime.cpu_quant_linear import FORMAT_CODES, kernel_takes

STACK_PARTS = 3  # kernels/stack_weights.h
DESC_WORDS = 8


def plain_bf16_weight(linear: nn.Module) -> Tensor | None:
    """The [out, in] bf16 weight a linear computes with, without copying: nn.Linear's, or the
    plain copy a PackedLinear keeps for the small-batch kernel (None if it kept none)."""
    weight = getattr(linear, "plain_weight", None)
    if weight is None and isinstance(linear, nn.Linear):
        weight = linear.weight
    if weight is None or weight.dtype != torch.bfloat16 or not weight.is_contiguous():
        return None
    return weight


def _part_row(fmt: int, rows: int, cols: int, data: Tensor, scale: Tensor | None) -> list[int]:
    return [fmt, rows, cols, data.data_ptr(), 0 if scale is None else scale.data_ptr(), 0, 0, 0]


def weight_parts(module: nn.Module) -> list[list[int]] | None:
    """Descriptor rows of a bf16 or quantized linear / embedding, or None if the stack cannot
    read it (a packed layer without its plain copy, a quantized part the kernels do not take)."""
    if isinstance(module, (QuantizedLinear, QuantizedEmbedding)):
        if not all(kernel_takes(p) for p in module.parts):
            return None
        return [_part_row(FORMAT_CODES[p.format], p.out_features, p.in_features, p.data, p.scale)
                for p in module.parts]
    weight = module.weight if isinstance(module, nn.Embedding) else plain_bf16_weight(module)
    if weight is None or weight.dtype != torch.bfloat16 or not weight.is_contiguous():
        return None
    return [_part_row(FORMAT_CODES["bf16"], weight.shape[0], weight.shape[1], weight, None)]


def slot_descriptors(module: nn.Module) -> Tensor | None:
    """[STACK_PARTS, DESC_WORDS] int64 for one weight slot, or None (see weight_parts)."""
    parts = weight_parts(module)
    if parts is None or len(parts) > STACK_PARTS:
        return None
    table = torch.zeros(STACK_PARTS, DESC_WORDS, dtype=torch.int64)
    table[:len(parts)] = torch.tensor(parts, dtype=torch.int64)
    return table


def tensors_of(module: nn.Module) -> list[Tensor]:
    """The tensors a slot's descriptors point into (kept alive by the stack)."""
    if isinstance(module, (QuantizedLinear, QuantizedEmbedding)):
        return [t for p in module.parts for t in (p.data, p.scale) if t is not None]
    weight = module.weight if isinstance(module, nn.Embedding) else plain_bf16_weight(module)
    return [] if weight is None else [weight]


def quantize_modules_for_test(model: nn.Module, formats: tuple[str, ...], gen: torch.Generator) -> None:
    """Replace a random bf16 Llama's projections (and its embedding table) with random
    quantized weights: `formats` = (qkv q|k, qkv v, o, gate_up, down, embedding). The qkv
    slot gets two parts when its formats differ. For the stack's self-test."""
    from deepinfer.runtime.cpu_quant_linear import random_blocks

    fq, fv, fo, fgu, fd, fe = formats
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        rows_qk = attn.q_size + attn.kv_size
        parts = [random_blocks(fq, rows_qk, attn.qkv_proj.in_features, gen),
                 random_blocks(fv, attn.kv_size, attn.qkv_proj.in_features, gen)]
        if fq == fv:
            parts = [QuantizedWeight(fq, rows_qk + attn.kv_size, parts[0].in_features,
                                     torch.cat([parts[0].data, parts[1].data]), None)
                     if parts[0].scale is None else random_blocks(fq, rows_qk + attn.kv_size,
                                                                  parts[0].in_features, gen)]
        attn.qkv_proj = QuantizedLinear(parts, attn.qkv_proj.bias)
        attn.o_proj = QuantizedLinear(random_blocks(fo, attn.o_proj.out_features,
                                                    attn.o_proj.in_features, gen), attn.o_proj.bias)
        mlp.gate_up_proj = QuantizedLinear(random_blocks(fgu, mlp.gate_up_proj.out_features,
                                                         mlp.gate_up_proj.in_features, gen))
        mlp.down_proj = QuantizedLinear(random_blocks(fd, mlp.down_proj.out_features,
                                                      mlp.down_proj.in_features, gen))
    table = model.model.embed_tokens
    model.model.embed_tokens = QuantizedEmbedding(
        random_blocks(fe, table.num_embeddings, table.embedding_dim, gen), torch.bfloat16)
