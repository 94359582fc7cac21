"""Encode fp32 matrices into GGUF block bytes for test fixtures, every type the engine computes.

Q4_0 / Q4_1 / Q8_0 come from the `gguf` package (llama.cpp's reference quantizers in numpy).
The package cannot encode K-quants, so those are encoded here from the block layouts of
ggml-common.h with a plain min/max fit (valid blocks a decoder must read exactly as llama.cpp
does; not llama.cpp's error-minimising search, which only changes which valid block is picked).
"""
from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

FORMAT_TYPES = {"q4_0": QT.Q4_0, "q4_1": QT.Q4_1, "q8_0": QT.Q8_0, "q4_k": QT.Q4_K,
                "q5_k": QT.Q5_K, "q6_k": QT.Q6_K}


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).view(np.uint8).reshape(-1, 2)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros_like(a), where=b != 0)


def _pack_k_scales(sc: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins per block [n, 8] -> the 12 packed bytes [n, 12]."""
    sc, mins = sc.astype(np.uint8), mins.astype(np.uint8)
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (mins[:, 0:4] & 63) | ((mins[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0xF) | ((mins[:, 4:8] & 0xF) << 4)
    return out


def _k_fit(x: np.ndarray, levels: int):
    """x [n, 8, 32] -> (d, dmin [n], 6-bit scales, mins [n, 8], q [n, 8, 32] in 0..levels)."""
    lo = np.minimum(x.min(axis=2), 0.0)
    step = (x.max(axis=2) - lo) / levels
    d = step.max(axis=1) / 63
    dmin = (-lo).max(axis=1) / 63
    d16, dmin16 = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(_safe_div(step, d16[:, None])), 0, 63)
    mins = np.clip(np.round(_safe_div(-lo, dmin16[:, None])), 0, 63)
    scale = (d16[:, None] * sc)[:, :, None]
    q = np.clip(np.round(_safe_div(x + (dmin16[:, None] * mins)[:, :, None], scale)), 0, levels)
    return d, dmin, sc, mins, q.astype(np.uint8)


def _q4_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, mins, q = _k_fit(x.reshape(-1, 8, 32), 15)
    q = q.reshape(-1, 4, 2, 32)  # chunk c: sub-block 2c in low nibbles, 2c+1 in high
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(sc, mins), qs], 1)


def _q5_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, mins, q = _k_fit(x.reshape(-1, 8, 32), 31)
    low = (q & 0xF).reshape(-1, 4, 2, 32)
    qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    qh = np.zeros((q.shape[0], 32), dtype=np.uint8)
    for j in range(8):  # sub-block j's fifth bit is bit j of qh
        qh |= ((q[:, j] >> 4) & 1) << j
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(sc, mins), qh, qs], 1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    x = x.reshape(-1, 16, 16)
    amax_idx = np.abs(x).argmax(axis=2)
    signed_max = np.take_along_axis(x, amax_idx[:, :, None], 2)[:, :, 0]
    step = signed_max / -32  # the largest magnitude maps to -32 (as llama.cpp's fit does)
    d = np.abs(step).max(axis=1) / 127
    d16 = d.astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(_safe_div(step, d16[:, None])), -128, 127)
    scale = (d16[:, None] * sc)[:, :, None]
    q = (np.clip(np.round(_safe_div(x, scale)), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)
    ql = q & 0xF  # [n, 2 halves, 4 groups of 32]: groups 0|2 and 1|3 share bytes
    ql = np.concatenate([ql[:, :, 0] | (ql[:, :, 2] << 4), ql[:, :, 1] | (ql[:, :, 3] << 4)], 2)
    hi = q >> 4
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64),
                           sc.astype(np.int8).view(np.uint8), _f16_bytes(d)], 1)


_K_ENCODERS = {"q4_k": _q4_k, "q5_k": _q5_k, "q6_k": _q6_k}


def encode(w: np.ndarray, fmt: str) -> np.ndarray:
    """fp32 [rows, cols] -> uint8 [rows, row bytes] of `fmt` blocks."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    if fmt in _K_ENCODERS:
        if w.shape[-1] % 256:
            raise ValueError(f"{fmt} needs rows of whole 256-value blocks, got {w.shape[-1]}")
        return _K_ENCODERS[fmt](w.reshape(-1, 256)).reshape(w.shape[0], -1)
    return gguf.quants.quantize(w, FORMAT_TYPES[fmt])


def decode(raw: np.ndarray, fmt: str) -> np.ndarray:
    """The gguf package's decoder (an implementation independent of the engine's)."""
    return gguf.quants.dequantize(raw, FORMAT_TYPES[fmt])
