"""The C small-batch bf16 linear (decode batches of 1..2 rows) against F.linear and oneDNN."""
from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.runtime import cpu_kernel_build, cpu_small_batch_linear
from deepinfer.runtime.cpu_linear_packing import (SMALL_BATCH_ROWS, UNPACKED_KERNEL_ROWS, PackedLinear,
                                                 pack_linear_weights)
from deepinfer.runtime.cpu_small_batch_linear import (MAX_ROWS, SmallBatchLinear,
                                                      load_small_batch_linear)


def _kernel() -> SmallBatchLinear:
    lib = cpu_kernel_build.load_kernel_library("small_batch_linear")
    assert lib is not None, "the C compiler is part of the supported setup; the build failed"
    return SmallBatchLinear(lib)


@pytest.mark.parametrize("rows", [1, 2, 3, MAX_ROWS])
def test_kernel_matches_float32_linear(rows):
    kernel = _kernel()
    for out_features, in_features in [(1, 5), (7, 31), (130, 33), (3072, 576), (576, 1536)]:
        _check(kernel, rows, out_features, in_features)


@pytest.mark.parametrize("num_threads", [1, 2])
def test_a_row_gives_the_same_bits_whatever_the_number_of_rows(num_threads):
    """A speculative verification step computes several positions of one request as rows of one
    call; each must equal the same row computed alone, or speculation changes bf16 outputs."""
    kernel = _kernel()
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        gen = torch.Generator().manual_seed(num_threads)
        for out_features, in_features in [(576, 1536), (49152, 576), (96, 100), (17, 129)]:
            x = torch.randn(MAX_ROWS, in_features, generator=gen).bfloat16()
            weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
            alone = torch.cat([kernel(x[i:i + 1], weight, None) for i in range(MAX_ROWS)])
            for rows in range(2, MAX_ROWS + 1):
                together = kernel(x[:rows], weight, None)
                assert torch.equal(together, alone[:rows]), (out_features, in_features, rows)
    finally:
        torch.set_num_threads(previous)


def _check(kernel, rows, out_features, in_features):
    gen = torch.Generator().manual_seed(rows * 1000 + in_features)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    weight = (torch.randn(out_features, in_features, generator=gen) / in_features ** 0.5).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16()
    for b in (None, bias):
        got = kernel(x, weight, b)
        want = F.linear(x.float(), weight.float(), None if b is None else b.float())
        assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
        # one bf16 rounding of a float32 sum (summation order differs)
        assert torch.allclose(got.float(), want, rtol=1e-2, atol=1e-2), (got.float() - want).abs().max()


def test_too_many_rows_is_an_error_not_a_wrong_answer():
    kernel = _kernel()
    with pytest.raises(RuntimeError, match="code 1"):
        kernel(torch.zeros(MAX_ROWS + 1, 8, dtype=torch.bfloat16),
               torch.zeros(4, 8, dtype=torch.bfloat16), None)


def _layers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(576, 960, bias=True), nn.Linear(960, 1536, bias=False)).bfloat16()
    return model.requires_grad_(False)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
def test_packed_linear_small_batches_use_the_kernel_and_agree_with_onednn(monkeypatch):
    monkeypatch.setenv("DEEPINFER_SMALL_BATCH_LINEAR", "1")
    load_small_batch_linear.cache_clear()
    model = _layers()
    plain = _layers()
    assert pack_linear_weights(model) == 2
    assert all(layer.small_batch is not None for layer in model)
    calls = []
    real = SmallBatchLinear.__call__
    monkeypatch.setattr(SmallBatchLinear, "__call__",
                        lambda self, *a: calls.append(a[0].shape[0]) or real(self, *a))
    with torch.inference_mode():
        for rows in (1, SMALL_BATCH_ROWS, SMALL_BATCH_ROWS + 1, 64):
            x = torch.randn(rows, 576).bfloat16()
            got, want = model(x), plain(x)
            assert torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2), rows
    if model[0].packed_weight is not None:
        assert calls == [1, 1, SMALL_BATCH_ROWS, SMALL_BATCH_ROWS]  # two layers each; wider -> oneDNN
    else:  # no packed weight (AVX2): every decode-sized batch, in calls of MAX_ROWS rows
        assert calls == [1, 1, SMALL_BATCH_ROWS, SMALL_BATCH_ROWS, SMALL_BATCH_ROWS + 1,
                         SMALL_BATCH_ROWS + 1] + [MAX_ROWS] * 16
    load_small_batch_linear.cache_clear()


def test_switch_off_keeps_onednn(monkeypatch):
    monkeypatch.setenv("DEEPINFER_SMALL_BATCH_LINEAR", "0")
    load_small_batch_linear.cache_clear()
    try:
        assert load_small_batch_linear() is None
        model = _layers()
        if pack_linear_weights(model):
            assert all(layer.small_batch is None for layer in model)
    finally:
        load_small_batch_linear.cache_clear()


def test_wrong_kernel_build_is_not_used(tmp_path, monkeypatch):
    """A miscompiled tail (the last partial vector dropped) fails the load-time self-test."""
    sources = tmp_path / "kernels"
    shutil.copytree(cpu_kernel_build.KERNEL_DIR, sources)
    path = sources / "gemv_bf16.h"  # the dot products small_batch_linear.c includes
    text = path.read_text()
    old = "for (int k = full; k < K; k += 32) {"
    assert old in text and "if (full < K) {" in text and "s += bf16_to_f32(wr[k])" in text
    text = text.replace(old, "for (int k = full; k < K - 32; k += 32) {")  # AVX512-BF16 build
    text = text.replace("if (full < K) {", "if (full < K - 32) {")  # AVX2 build
    text = text.replace("for (int k = 0; k < K; k++) s +=", "for (int k = 0; k < K - 1; k++) s +=")
    path.write_text(text)
    monkeypatch.setattr(cpu_kernel_build, "KERNEL_DIR", sources)
    monkeypatch.setattr(cpu_kernel_build, "_VERDICTS", {})
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("DEEPINFER_SMALL_BATCH_LINEAR", "1")
    load_small_batch_linear.cache_clear()
    try:
        assert cpu_small_batch_linear.load_small_batch_linear() is None
    finally:
        load_small_batch_linear.cache_clear()


def test_unpacked_linear_takes_decode_batches_in_calls_of_max_rows(monkeypatch):
    """Without a packed weight, 9..UNPACKED_KERNEL_ROWS rows run the kernel MAX_ROWS rows at a
    time: each row equals that row alone (forward and the head's float32 logits), and agrees
    with F.linear; more rows keep F.linear."""
    monkeypatch.setenv("DEEPINFER_SMALL_BATCH_LINEAR", "1")
    load_small_batch_linear.cache_clear()
    try:
        torch.manual_seed(1)
        linear = nn.Linear(200, 70, bias=False).bfloat16().requires_grad_(False)
        layer = PackedLinear(linear, None, load_small_batch_linear())
        with torch.inference_mode():
            for rows in (MAX_ROWS + 1, 20, UNPACKED_KERNEL_ROWS):
                x = torch.randn(rows, 200).bfloat16()
                got, logits = layer(x), layer.logits_f32(x)
                alone = torch.cat([layer(x[i:i + 1]) for i in range(rows)])
                alone_logits = torch.cat([layer.logits_f32(x[i:i + 1]) for i in range(rows)])
                assert torch.equal(got, alone) and torch.equal(logits, alone_logits), rows
                want = F.linear(x.float(), linear.weight.float())
                assert torch.allclose(logits, want, rtol=1e-4, atol=1e-4), rows
                assert torch.allclose(got.float(), want, rtol=1e-2, atol=1e-2), rows
            x = torch.randn(UNPACKED_KERNEL_ROWS + 1, 200).bfloat16()
            assert layer.logits_f32(x) is None
            assert torch.equal(layer(x), F.linear(x, linear.weight))
    finally:
        load_small_batch_linear.cache_clear()
