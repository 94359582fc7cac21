"""The quantized weight contract: each format's reference dequantize against the `gguf`
package's own decoder (GGUF types) or the format's definition (fp8 block, int8), row slices,
byte counts, and layout validation."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer.quant.quantized_linear import QuantizedEmbedding, QuantizedLinear
from deepinfer.quant.quantized_weight import (FP8_BLOCK, GGUF_BLOCKS, INT8, QuantizedWeight,
                                              quantize_fp8_block, quantize_int8)
from tests.quant_blocks import decode, encode

def gguf_weight(fmt: str, out: int, cols: int, seed: int = 0) -> tuple[QuantizedWeight, np.ndarray]:
    """A random matrix in `fmt` blocks; (weight, the gguf package's dequantization of it)."""
    w = np.random.default_rng(seed).standard_normal((out, cols)).astype(np.float32)
    raw = encode(w, fmt)
    qw = QuantizedWeight(fmt, out, cols, torch.from_numpy(raw.copy()))
    return qw, decode(raw, fmt)


@pytest.mark.parametrize("fmt", list(GGUF_BLOCKS))
def test_gguf_dequantize_matches_gguf_package(fmt):
    qw, want = gguf_weight(fmt, 5, 512)
    got = qw.dequantize(torch.float32).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)  # fp32, other op order
    assert qw.nbytes == 5 * 512 // GGUF_BLOCKS[fmt][0] * GGUF_BLOCKS[fmt][1]


@pytest.mark.parametrize("fmt", list(GGUF_BLOCKS))
def test_test_encoder_is_close_to_its_input(fmt):
    """The fixtures' encoder: the worst error within the type's step size."""
    w = np.random.default_rng(5).standard_normal((4, 512)).astype(np.float32)
    err = np.abs(decode(encode(w, fmt), fmt) - w).max()
    assert err < {"q8_0": 0.02, "q6_k": 0.08}.get(fmt, 0.5), err


@pytest.mark.parametrize("fmt", list(GGUF_BLOCKS))
def test_row_slices_and_lookups_are_rows_of_the_whole(fmt):
    qw, want = gguf_weight(fmt, 9, 256, seed=1)
    part = qw.narrow_rows(3, 4)
    assert part.data.data_ptr() == qw.data[3].data_ptr()  # a view, no copy
    torch.testing.assert_close(part.dequantize(), qw.dequantize()[3:7], rtol=0, atol=0)
    ids = torch.tensor([8, 0, 8])
    torch.testing.assert_close(qw.dequantize_rows(ids), qw.dequantize()[[8, 0, 8]], rtol=0, atol=0)


def test_int8_per_channel():
    w = torch.randn(7, 40, generator=torch.Generator().manual_seed(2))
    w[3] = 0  # a zero row must not divide by zero
    qw = quantize_int8(w)
    assert qw.format == INT8 and qw.data.dtype == torch.int8 and qw.scale.shape == (7,)
    err = (qw.dequantize() - w).abs().amax(dim=1)
    assert (err <= w.abs().amax(dim=1) / 254 + 1e-7).all()  # half a step of max|row| / 127
    assert qw.nbytes == 7 * 40 + 7 * 4


@pytest.mark.parametrize("shape", [(128, 128), (200, 300), (1, 129), (257, 64)])
def test_fp8_block_partial_blocks(shape):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(3))
    qw = quantize_fp8_block(w)
    assert qw.scale.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    want = qw.data.float() * qw.scale.repeat_interleave(128, 0)[:shape[0]].repeat_interleave(128, 1)[:, :shape[1]]
    torch.testing.assert_close(qw.dequantize(), want, rtol=0, atol=0)
    # e4m3 keeps 3 mantissa bits: relative error <= 1/16 of each value (or tiny near zero).
    assert ((qw.dequantize() - w).abs() <= w.abs() / 16 + qw.scale.max() * 2 ** -9).all()
    if shape[0] > 128:
        tail = qw.narrow_rows(128, shape[0] - 128)
        torch.testing.assert_close(tail.dequantize(), qw.dequantize()[128:], rtol=0, atol=0)
        with pytest.raises(ValueError, match="multiple of 128"):
            qw.narrow_rows(1, 10)


def test_bad_layouts_are_refused():
    with pytest.raises(ValueError, match="unknown format"):
        QuantizedWeight("q3_x", 2, 32, torch.zeros(2, 18, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        QuantizedWeight("q4_0", 2, 32, torch.zeros(2, 17, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of the 256"):
        QuantizedWeight("q6_k", 2, 32, torch.zeros(2, 26, dtype=torch.uint8))
    with pytest.raises(ValueError, match="scale"):
        QuantizedWeight(INT8, 2, 4, torch.zeros(2, 4, dtype=torch.int8), torch.ones(3))
    with pytest.raises(ValueError, match="scale"):
        QuantizedWeight(FP8_BLOCK, 2, 4, torch.zeros(2, 4, dtype=torch.float8_e4m3fn),
                        torch.ones(2, 1), (128, 128))
    with pytest.raises(ValueError, match="outside"):
        quantize_int8(torch.ones(2, 4)).narrow_rows(1, 2)


def test_modules_reference_path():
    qw, want = gguf_weight("q8_0", 6, 64, seed=4)
    bias = torch.randn(6)
    layer = QuantizedLinear(qw, bias)
    x = torch.randn(2, 3, 64)
    torch.testing.assert_close(layer(x), x @ torch.from_numpy(want).T + bias, rtol=1e-5, atol=1e-5)
    emb = QuantizedEmbedding(qw, torch.bfloat16)
    out = emb(torch.tensor([[5, 1]]))
    assert out.shape == (1, 2, 64) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out[0].float(), torch.from_numpy(want[[5, 1]]).bfloat16().float(),
                               rtol=1e-2, atol=1e-2)
    with pytest.raises(IndexError):
        emb(torch.tensor([6]))
