"""Pre-packed oneDNN weights for bf16 linear layers on CPU.

`F.linear` on a plain bf16 weight lets oneDNN reorder the weight into its AMX/AVX-512 blocked
layout on every call. Reordering once at load time removes that from every step; it matters
most for decode-sized batches (measured on this 2-core Sapphire Rapids box, 64 tokens:
gate_up 0.26 -> 0.17 ms, down 0.16 -> 0.11 ms; 2048 tokens: unchanged). Each packed layer is
checked against F.linear once and left alone if the op is missing or disagrees.

Batches of at most `SMALL_BATCH_ROWS` rows (batch-1/2 decode) go to the C kernel of
cpu_small_batch_linear instead, which reads the plain weight (kept beside the packed copy, so
the linear weights take twice the memory) at memory speed where oneDNN's GEMM does not
(Zen 4, one thread, 40 cold 576x3072 layers: M=1 262 -> 185 us, M=2 336 -> 251 us; M=4 even).

A model with quantized weights keeps one copy of its bf16 LM head (untied, or the tied
embedding table): a `PackedLinear` without a packed weight (logits from the small-batch
kernel's float32 dots, in calls of 8 rows up to UNPACKED_KERNEL_ROWS, F.linear on the plain
weight beyond). Its layers are
quantized, so the head is most of what stays bf16, and a second copy of it would be most of
the resident overhead.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deepinfer.runtime.cpu_huge_pages import move_to_huge_pages
from deepinfer.runtime.cpu_small_batch_linear import (MAX_ROWS, SmallBatchLinear,
                                                       load_small_batch_linear)

logger = logging.getLogger(__name__)

_PACK_BATCH_HINT = 64  # oneDNN picks its blocking for this M; measured insensitive 16..2048
SMALL_BATCH_ROWS = 2  # up to this many rows: the C kernel (M=4 measured level with oneDNN)
# Without a packed weight (AVX2 without AVX-NE-CONVERT) oneDNN's bf16 GEMM on the plain weight
# is slow at every decode size (Zen 3, one thread, 1536x1024: 16 rows 5.5 ms, 64 rows 21.5 ms)
# while the kernel in calls of MAX_ROWS rows takes 1.4 / 6.3 ms: decode and verify steps up to
# this many rows take the kernel then, larger (prefill) chunks keep F.linear.
UNPACKED_KERNEL_ROWS = 128


def _ops_available() -> bool:
    mkldnn = getattr(torch.ops, "mkldnn", None)
    return (torch.backends.mkldnn.is_available()
            and hasattr(mkldnn, "_reorder_linear_weight")
            and hasattr(mkldnn, "_linear_pointwise"))


class PackedLinear(nn.Module):
    """Drop-in for an inference-only nn.Linear whose weight was reordered for oneDNN. With
    `packed_weight` None it keeps only the plain weight: a CPU whose oneDNN has no bf16
    reorder (AVX2 without AVX-NE-CONVERT), or a quantized model's LM head (one copy). Then
    the small-batch kernel takes decode rows and F.linear on the plain weight the rest."""

    def __init__(self, linear: nn.Linear, packed_weight: Tensor | None,
                 small_batch: SmallBatchLinear | None = None) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.register_buffer("packed_weight", packed_weight, persistent=False)
        self.bias = linear.bias
        # The plain weight for the small-batch kernel; None keeps oneDNN for every batch.
        self.small_batch = small_batch
        self.plain_weight = linear.weight.detach() if small_batch is not None else None
        if packed_weight is None and small_batch is None:
            raise ValueError("a PackedLinear without a packed weight needs the small-batch kernel")

    def logits_f32(self, x: Tensor) -> Tensor | None:
        """x @ weight.T in float32 from the small-batch kernel (no bias; for an LM head), or
        None when that kernel does not take `x` (then use forward). Rows <= the kernel's
        MAX_ROWS, not SMALL_BATCH_ROWS: a row's logits must not depend on how many rows share
        the call (a speculative verification row == the same position decoded alone)."""
        if self.small_batch is None or self.bias is not None:
            return None
        if self.small_batch.applies(x, self.plain_weight):
            return self.small_batch.dots_f32(x, self.plain_weight)
        if self._unpacked_kernel_rows(x):  # in calls of MAX_ROWS rows: still per-row logits
            return _in_row_calls(
                lambda rows: self.small_batch.dots_f32(rows, self.plain_weight), x)
        return None

    def _unpacked_kernel_rows(self, x: Tensor) -> bool:
        """No packed weight and a decode-sized x the kernel takes (in calls of MAX_ROWS rows)."""
        return (self.packed_weight is None and self.small_batch is not None and x.dim() == 2
                and x.shape[0] <= UNPACKED_KERNEL_ROWS
                and self.small_batch.applies(x[:MAX_ROWS], self.plain_weight))

    def forward(self, x: Tensor) -> Tensor:
        if (self.small_batch is not None and x.dim() == 2 and x.shape[0] <= SMALL_BATCH_ROWS
                and self.small_batch.applies(x, self.plain_weight)):
            return self.small_batch(x, self.plain_weight, self.bias)
        if self.packed_weight is None:
            if self._unpacked_kernel_rows(x):
                return _in_row_calls(
                    lambda rows: self.small_batch(rows, self.plain_weight, self.bias), x)
            return F.linear(x, self.plain_weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none",
                                                  [None], "")


def _in_row_calls(call, x: Tensor) -> Tensor:
    """`call(x)` for at most MAX_ROWS rows, else over consecutive MAX_ROWS-row slices."""
    if x.shape[0] <= MAX_ROWS:
        return call(x)
    return torch.cat([call(x[i:i + MAX_ROWS]) for i in range(0, x.shape[0], MAX_ROWS)])


def _try_pack(linear: nn.Linear) -> PackedLinear | None:
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight, _PACK_BATCH_HINT)
    except (RuntimeError, TypeError, AttributeError) as e:
        logger.debug("oneDNN weight packing unavailable: %s", e)
        small_batch = load_small_batch_linear()  # decode rows still stream the plain weight
        return PackedLinear(linear, None, small_batch) if small_batch is not None else None
    try:
        layer = PackedLinear(linear, packed)  # checked on the oneDNN path (3 rows)
        probe = torch.randn(3, linear.in_features, dtype=linear.weight.dtype)
        with torch.inference_mode():
            ok = torch.allclose(layer(probe).float(), F.linear(probe, linear.weight, linear.bias).float(),
                                rtol=2e-2, atol=2e-2)
        if not ok:
            return None
        small_batch = load_small_batch_linear()  # self-tested against F.linear at load
        return PackedLinear(linear, packed, small_batch) if small_batch is not None else layer
    except (RuntimeError, TypeError, AttributeError) as e:
        logger.debug("oneDNN weight packing unavailable: %s", e)
        return None


def pack_linear_weights(model: nn.Module) -> int:
    """Replace the bf16 CPU nn.Linear layers of `model` in place; returns how many (a
    quantized model's LM head, kept in one copy, counts too)."""
    from deepinfer.models.quantized_model import quantized_modules

    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children()
               if isinstance(child, nn.Linear) and child.weight.device.type == "cpu"
               and child.weight.dtype == torch.bfloat16]
    _plain_weights_to_huge_pages(model, [child.weight for _, _, child in targets])
    quantized = bool(quantized_modules(model))
    if quantized:
        head = getattr(model, "lm_head", None)
        targets = [t for t in targets if t[2] is not head]
        num_heads = _one_copy_head(model)
    else:
        num_heads = 0
    if not _ops_available():
        return num_heads
    num = 0
    for parent, name, child in targets:
        layer = _try_pack(child)
        if layer is None:
            return num + num_heads  # same op for every layer: if one fails, keep the rest plain
        setattr(parent, name, layer)
        num += 1
    return num + num_heads + (0 if quantized else _pack_tied_lm_head(model))


def _one_copy_head(model: nn.Module) -> int:
    """A quantized model's bf16 head (untied `lm_head`, or the tied embedding table when no
    quantized head serves the logits) behind the small-batch kernel, no packed copy; 1 if so."""
    small_batch = load_small_batch_linear()
    if small_batch is None or not hasattr(model, "logits_linear"):
        return 0
    head = getattr(model, "lm_head", None)
    if head is None:
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if (model.logits_linear is not None or not isinstance(embed, nn.Embedding)
                or embed.weight.device.type != "cpu" or embed.weight.dtype != torch.bfloat16):
            return 0
        vocab, hidden = embed.weight.shape
        linear = nn.Linear(hidden, vocab, bias=False, device="meta")
        linear.weight = nn.Parameter(embed.weight, requires_grad=False)
        model.logits_linear = PackedLinear(linear, None, small_batch)
        return 1
    if (not isinstance(head, nn.Linear) or head.weight.device.type != "cpu"
            or head.weight.dtype != torch.bfloat16):
        return 0
    model.lm_head = PackedLinear(head, None, small_batch)
    return 1


def _plain_weights_to_huge_pages(model: nn.Module, weights: list[Tensor]) -> None:
    """The weights the small-batch GEMVs and the decode stack stream every step (the plain
    copies; a tied head's embedding table too) onto 2 MiB pages, before any alias of them is
    taken (PackedLinear.plain_weight, the stack's pointers)."""
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if (hasattr(model, "logits_linear") and getattr(model, "lm_head", None) is None
            and isinstance(embed, nn.Embedding) and embed.weight.device.type == "cpu"
            and embed.weight.dtype == torch.bfloat16):
        weights = [*weights, embed.weight]
    moved = move_to_huge_pages(weights) if weights else 0
    if moved:
        logger.info("%.0f MiB of bf16 weights on transparent huge pages", moved / 2 ** 20)


def _pack_tied_lm_head(model: nn.Module) -> int:
    """A tied LM head shares the embedding table, which must stay plain for lookups: pack a
    copy for the logits matmul (64 decode rows x 49152 vocab: 4.4 -> 2.5 ms)."""
    if (not hasattr(model, "logits_linear") or getattr(model, "lm_head", None) is not None
            or model.logits_linear is not None
            or not isinstance(model.model.embed_tokens, nn.Embedding)):
        return 0  # untied, already served (a quantized table's head), or not a plain table
    embed = model.model.embed_tokens.weight
    if embed.device.type != "cpu" or embed.dtype != torch.bfloat16:
        return 0
    vocab, hidden = embed.shape
    linear = nn.Linear(hidden, vocab, bias=False, device="meta")
    linear.weight = nn.Parameter(embed, requires_grad=False)
    layer = _try_pack(linear)
    if layer is None:
        return 0
    model.logits_linear = layer
    return 1
