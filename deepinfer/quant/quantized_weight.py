"""The weight contract for quantized linear layers: one data-only `QuantizedWeight` per matrix,
kept in its own format (never expanded to a second bf16 copy), with a reference dequantize in
torch that every kernel is checked against.

Formats and their tensors (`out` = out_features rows, `in` = in_features columns):

    GGUF block quants (llama.cpp's block bytes, each row its own run of blocks):
      q4_0 q4_1 q8_0   32 values a block      data uint8 [out, in / 32 * bytes_per_block]
      q4_k q5_k q6_k  256 values a block      data uint8 [out, in / 256 * bytes_per_block]
    fp8_block   data float8_e4m3fn [out, in]; scale float32 scale_inv
                [ceil(out / 128), ceil(in / 128)], W = data * scale per 128 x 128 block
                (block=(128, 128); the last blocks of a matrix may be partial)
    int8        data int8 [out, in]; scale float32 [out] (per output channel, symmetric);
                activations are quantized per token at run time (W8A8, dynamic)

Block byte layouts (from ggml-common.h; d / dmin / m are float16):

    q4_0  | d | qs[16] |                 v[j] = d * (lo(qs[j]) - 8), v[j+16] = d * (hi(qs[j]) - 8)
    q4_1  | d | m | qs[16] |             v = d * nibble + m
    q8_0  | d | qs[32] int8 |            v = d * qs
    q4_k  | d | dmin | sc[12] | qs[128] |          8 sub-blocks of 32, 6-bit scale and min each
    q5_k  | d | dmin | sc[12] | qh[32] | qs[128] |  as q4_k plus a fifth bit from qh
    q6_k  | ql[128] | qh[64] | sc[16] int8 | d |    16 sub-blocks of 16, 6-bit values - 32

Rows are independent, so row slices (a fused projection's part, an MoE expert's [out, in]
slice) are views: `narrow_rows`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

# format -> (values per block, bytes per block)
GGUF_BLOCKS: dict[str, tuple[int, int]] = {
    "q4_0": (32, 18), "q4_1": (32, 20), "q8_0": (32, 34),
    "q4_k": (256, 144), "q5_k": (256, 176), "q6_k": (256, 210),
}
FP8_BLOCK = "fp8_block"
INT8 = "int8"
FORMATS = (*GGUF_BLOCKS, FP8_BLOCK, INT8)
FP8_BLOCK_SHAPE = (128, 128)


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """One [out_features, in_features] matrix in `format` (see the module docstring).

    `data` holds the values (GGUF: the raw block bytes); `scale` the fp8 block scale_inv or
    the int8 per-channel scales (None for GGUF, whose scales live inside the blocks); `block`
    the fp8 block shape. Construction validates every shape and dtype (ValueError)."""

    format: str
    out_features: int
    in_features: int
    data: Tensor
    scale: Tensor | None = None
    block: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        problem = _layout_problem(self)
        if problem is not None:
            raise ValueError(f"{self.format} weight [{self.out_features}, {self.in_features}]: "
                             f"{problem}")

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def nbytes(self) -> int:
        """Bytes held in memory (values and scales)."""
        scale = 0 if self.scale is None else self.scale.numel() * self.scale.element_size()
        return self.data.numel() * self.data.element_size() + scale

    @property
    def device(self) -> torch.device:
        return self.data.device

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The reference values, [out_features, in_features] in `dtype` (computed in fp32)."""
        return _dequantize(self).to(dtype)

    def dequantize_rows(self, row_ids: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        """Rows `row_ids` [n] dequantized -> [n, in_features] (an embedding lookup)."""
        return self.select_rows(row_ids).dequantize(dtype)

    def select_rows(self, row_ids: Tensor) -> QuantizedWeight:
        """A copy holding rows `row_ids` only (GGUF and int8; fp8 blocks span 128 rows)."""
        if self.format == FP8_BLOCK:
            full = self.dequantize(torch.float32).index_select(0, row_ids)
            return quantize_fp8_block(full, self.block)
        scale = None if self.scale is None else self.scale.index_select(0, row_ids)
        return QuantizedWeight(self.format, int(row_ids.numel()), self.in_features,
                               self.data.index_select(0, row_ids), scale, self.block)

    def narrow_rows(self, start: int, length: int) -> QuantizedWeight:
        """Rows [start, start + length) as views (no copy). fp8: `start` must be a multiple of
        the block height (its scales are per block); a partial last block is fine."""
        if start < 0 or length < 0 or start + length > self.out_features:
            raise ValueError(f"rows [{start}, {start + length}) outside {self.out_features}")
        data = self.data.narrow(0, start, length)
        scale = self.scale
        if self.format == FP8_BLOCK:
            rows = self.block[0]
            if start % rows:
                raise ValueError(f"fp8 row slice must start at a multiple of {rows}, got {start}")
            scale = scale.narrow(0, start // rows, -(-length // rows))
        elif self.format == INT8:
            scale = scale.narrow(0, start, length)
        return QuantizedWeight(self.format, length, self.in_features, data, scale, self.block)

    def to(self, device: torch.device | str) -> QuantizedWeight:
        scale = None if self.scale is None else self.scale.to(device)
        return QuantizedWeight(self.format, self.out_features, self.in_features,
                               self.data.to(device), scale, self.block)


def row_bytes(fmt: str, in_features: int) -> int:
    """Bytes of one GGUF row of `in_features` values."""
    values, size = GGUF_BLOCKS[fmt]
    return in_features // values * size


def _layout_problem(w: QuantizedWeight) -> str | None:
    if w.format not in FORMATS:
        return f"unknown format (known: {', '.join(FORMATS)})"
    if w.out_features < 0 or w.in_features < 1:
        return "bad shape"
    data = w.data
    if w.format in GGUF_BLOCKS:
        values, _ = GGUF_BLOCKS[w.format]
        if w.in_features % values:
            return f"in_features is not a multiple of the {values}-value block"
        want = (w.out_features, row_bytes(w.format, w.in_features))
        if data.dtype != torch.uint8 or tuple(data.shape) != want:
            return f"data must be uint8 {list(want)}, got {data.dtype} {list(data.shape)}"
        if w.scale is not None:
            return "GGUF blocks carry their own scales (scale must be None)"
        return None
    if tuple(data.shape) != w.shape:
        return f"data shape {list(data.shape)}"
    if w.format == FP8_BLOCK:
        if data.dtype != torch.float8_e4m3fn:
            return f"data must be float8_e4m3fn, got {data.dtype}"
        if w.block is None or len(w.block) != 2 or min(w.block) < 1:
            return "fp8 needs a block shape"
        want = (-(-w.out_features // w.block[0]), -(-w.in_features // w.block[1]))
    else:
        if data.dtype != torch.int8:
            return f"data must be int8, got {data.dtype}"
        want = (w.out_features,)
    if w.scale is None or w.scale.dtype != torch.float32 or tuple(w.scale.shape) != want:
        got = None if w.scale is None else (w.scale.dtype, list(w.scale.shape))
        return f"scale must be float32 {list(want)}, got {got}"
    return None


# ---- reference dequantization (torch, fp32) ------------------------------------------------

def _f16(raw: Tensor) -> Tensor:
    """[..., 2] uint8 -> [..., 1] float32 (little-endian float16)."""
    return raw.contiguous().view(torch.float16).float()


def _nibbles(qs: Tensor) -> tuple[Tensor, Tensor]:
    return (qs & 0xF).float(), (qs >> 4).float()


def _q4_0(b: Tensor) -> Tensor:  # b [n, 18] -> [n, 32]
    lo, hi = _nibbles(b[:, 2:18])
    return _f16(b[:, 0:2]) * (torch.cat([lo, hi], 1) - 8)


def _q4_1(b: Tensor) -> Tensor:
    lo, hi = _nibbles(b[:, 4:20])
    return _f16(b[:, 0:2]) * torch.cat([lo, hi], 1) + _f16(b[:, 2:4])


def _q8_0(b: Tensor) -> Tensor:
    return _f16(b[:, 0:2]) * b[:, 2:34].contiguous().view(torch.int8).float()


def k_scales_mins(sc: Tensor) -> tuple[Tensor, Tensor]:
    """The 12 packed bytes of a q4_k / q5_k block -> 8 six-bit scales and 8 mins, [n, 8]."""
    sc = sc.int()
    lo_s, lo_m = sc[:, 0:4] & 63, sc[:, 4:8] & 63
    hi_s = (sc[:, 8:12] & 0xF) | ((sc[:, 0:4] >> 6) << 4)
    hi_m = (sc[:, 8:12] >> 4) | ((sc[:, 4:8] >> 6) << 4)
    return torch.cat([lo_s, hi_s], 1).float(), torch.cat([lo_m, hi_m], 1).float()


def _k_sub_blocks(b: Tensor, q: Tensor) -> Tensor:
    """q [n, 8, 32] sub-block values of a q4_k / q5_k block -> [n, 256]."""
    scales, mins = k_scales_mins(b[:, 4:16])
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    return ((d * scales)[:, :, None] * q - (dmin * mins)[:, :, None]).reshape(-1, 256)


def _q4_k(b: Tensor) -> Tensor:
    lo, hi = _nibbles(b[:, 16:144].reshape(-1, 4, 32))  # each 32 bytes: sub-blocks 2c, 2c+1
    return _k_sub_blocks(b, torch.stack([lo, hi], 2).reshape(-1, 8, 32))


def _q5_k(b: Tensor) -> Tensor:
    lo, hi = _nibbles(b[:, 48:176].reshape(-1, 4, 32))
    qh = b[:, 16:48].int()  # bit 2c (low nibbles of chunk c), 2c+1 (high)
    bits = torch.stack([(qh >> s) & 1 for s in range(8)], 1).float() * 16  # [n, 8, 32]
    q = torch.stack([lo, hi], 2).reshape(-1, 8, 32) + bits
    return _k_sub_blocks(b, q)


def _q6_k(b: Tensor) -> Tensor:
    ql = b[:, 0:128].reshape(-1, 2, 64).int()
    qh = b[:, 128:192].reshape(-1, 2, 32).int()
    sc = b[:, 192:208].contiguous().view(torch.int8).float()  # [n, 16], one per 16 values
    parts = [(ql[:, :, 0:32] & 0xF) | ((qh & 3) << 4),
             (ql[:, :, 32:64] & 0xF) | (((qh >> 2) & 3) << 4),
             (ql[:, :, 0:32] >> 4) | (((qh >> 4) & 3) << 4),
             (ql[:, :, 32:64] >> 4) | (((qh >> 6) & 3) << 4)]
    q = (torch.stack(parts, 2).reshape(-1, 256) - 32).float()  # [n, 2 halves x 128]
    return _f16(b[:, 208:210]) * sc.repeat_interleave(16, 1) * q


_GGUF_DEQUANT = {"q4_0": _q4_0, "q4_1": _q4_1, "q8_0": _q8_0,
                 "q4_k": _q4_k, "q5_k": _q5_k, "q6_k": _q6_k}


def _dequantize(w: QuantizedWeight) -> Tensor:
    out, cols = w.shape
    if w.format in GGUF_BLOCKS:
        _, size = GGUF_BLOCKS[w.format]
        blocks = w.data.reshape(-1, size)
        return _GGUF_DEQUANT[w.format](blocks).reshape(out, cols)
    values = w.data.float()
    if w.format == INT8:
        return values * w.scale[:, None]
    rows, width = w.block
    scale = w.scale.repeat_interleave(rows, 0)[:out].repeat_interleave(width, 1)[:, :cols]
    return values * scale


# ---- quantizers (load-time int8, test fixtures for fp8) -------------------------------------

def quantize_int8(weight: Tensor) -> QuantizedWeight:
    """Symmetric per-output-channel int8: scale = max|row| / 127 (a zero row gets scale 1)."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight(INT8, w.shape[0], w.shape[1], q, scale.float().contiguous())


FP8_E4M3_MAX = 448.0


def quantize_fp8_block(weight: Tensor, block: tuple[int, int] = FP8_BLOCK_SHAPE) -> QuantizedWeight:
    """Per-block e4m3 with scale_inv = max|block| / 448, as DeepSeek's checkpoints store it."""
    w = weight.detach().float()
    out, cols = w.shape
    rows, width = block
    pad = torch.zeros(-(-out // rows) * rows, -(-cols // width) * width)
    pad[:out, :cols] = w
    tiles = pad.view(pad.shape[0] // rows, rows, pad.shape[1] // width, width)
    amax = tiles.abs().amax(dim=(1, 3))  # [out blocks, in blocks]
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    q = (tiles / scale[:, None, :, None]).view_as(pad)[:out, :cols]
    return QuantizedWeight(FP8_BLOCK, out, cols, q.to(torch.float8_e4m3fn).contiguous(),
                           scale.contiguous(), tuple(block))
