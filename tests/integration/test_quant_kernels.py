"""The quantized CPU kernels (runtime/kernels/quant_linear.c) at every instruction set this
build has, against the torch reference dequantize: the load-time self-test per ISA, FP8 at
model-sized shapes with partial blocks, every e4m3 code, int8 sums exact on every path, and
that an AVX2 host gets the AVX2 kernels rather than the portable ones."""
from __future__ import annotations

import pytest
import torch

from deepinfer.quant.quantized_weight import FP8_BLOCK, INT8, QuantizedWeight, quantize_int8
from deepinfer.runtime.cpu_kernel_build import cpu_identity, load_kernel_library
from deepinfer.runtime.cpu_quant_linear import (ISA_CODES, QuantLinearKernel, load_quant_linear,
                                                quant_linear_mismatch, quantized_activations,
                                                random_blocks)

pytestmark = pytest.mark.timeout(600)


def _host_flags() -> set[str]:
    for line in cpu_identity().splitlines():
        if line.split(":")[0].strip() == "flags":
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.fixture(scope="module")
def library():
    lib = load_kernel_library("quant_linear")
    if lib is None:
        pytest.skip("no C compiler: the quantized layers keep their torch path")
    return lib


def _kernel(library, isa: str) -> QuantLinearKernel:
    kernel = QuantLinearKernel(library, ISA_CODES[isa])
    if kernel.isa != ISA_CODES[isa]:
        pytest.skip(f"this build has no {isa} path (best: {kernel.isa_name})")
    return kernel


@pytest.mark.parametrize("isa", ["portable", "avx2", "avx512"])
def test_self_test_passes_at_every_compiled_isa(library, isa):
    with torch.inference_mode():
        assert quant_linear_mismatch(_kernel(library, isa)) is None


def test_avx2_host_runs_the_avx2_kernels():
    """Not silently portable: a host with AVX2 + FMA + F16C verifies and uses at least AVX2."""
    flags = _host_flags()
    if not {"avx2", "fma", "f16c"} <= flags:
        pytest.skip("host without AVX2 + FMA + F16C")
    kernel = load_quant_linear()
    assert kernel is not None, "the quantized kernel failed its self-test on this host"
    want = "avx512" if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"} <= flags else "avx2"
    assert kernel.isa_name == want


@pytest.mark.parametrize("isa", ["portable", "avx2", "avx512"])
@pytest.mark.parametrize("rows, cols", [(4096, 4096), (300, 1000), (129, 2088)])
def test_fp8_equals_dequantized_reference(library, isa, rows, cols):
    """Decode-sized row counts (1..8 and a chunked 13), bf16 and float32 outputs and inputs,
    against x @ dequantize(W).T: float32 sums in another order are the only difference."""
    kernel = _kernel(library, isa)
    gen = torch.Generator().manual_seed(rows + cols)
    if rows * cols > 4_000_000 and isa == "portable":
        rows = 1024  # the portable path is slow; its shape logic is the same
    weight = random_blocks(FP8_BLOCK, rows, cols, gen)
    w = weight.dequantize(torch.float32)
    for m in (1, 2, 5, 8, 13):
        x = torch.randn(m, cols, generator=gen)
        for dtype in (torch.bfloat16, torch.float32):
            xd = x.to(dtype)
            want = xd.float() @ w.T
            tol = 1e-5 * (xd.float().abs() @ w.abs().T) + 1e-30
            got = kernel.linear(xd, weight, None)
            bound = tol if dtype == torch.float32 else tol + 2 ** -8 * want.abs()
            assert ((got.float() - want).abs() <= bound).all(), (m, dtype)
            if dtype == torch.bfloat16:
                assert ((kernel.dots_f32(xd, weight) - want).abs() <= tol).all(), m


@pytest.mark.parametrize("isa", ["portable", "avx2", "avx512"])
def test_every_e4m3_code_converts_exactly(library, isa):
    """Each of the 254 finite codes (subnormals, both zeros) as one weight, read by a one-hot
    input: the kernel's float32 dot is the reference value times the block scale, exactly."""
    kernel = _kernel(library, isa)
    codes = torch.tensor([c for c in range(256) if c not in (0x7F, 0xFF)], dtype=torch.uint8)
    cols = 160  # a partial second block
    data = torch.zeros(len(codes), cols, dtype=torch.uint8)
    data[:, 131] = codes
    weight = QuantizedWeight(FP8_BLOCK, len(codes), cols, data.view(torch.float8_e4m3fn),
                             torch.tensor([[0.5, 0.25]] * 2), (128, 128))
    x = torch.zeros(1, cols, dtype=torch.bfloat16)
    x[0, 131] = 1.0
    want = codes.view(torch.float8_e4m3fn).float() * 0.25
    assert torch.equal(kernel.dots_f32(x, weight)[0], want)


@pytest.mark.parametrize("isa", ["portable", "avx2", "avx512"])
def test_bf16_activations_are_quantized_as_the_reference(library, isa):
    """A q8_0 identity (scale 1, code 1 on the diagonal) reads each activation's int8 value
    back: equal, bit for bit, to the torch rounding of the kernel's rule, on inputs full of
    ties (multiples of 1/64 and blocks at exactly max|x| / 2), decode and prefill row counts."""
    kernel = _kernel(library, isa)
    cols = 576  # not whole 128-value groups: padding
    blocks = torch.zeros(cols, cols // 32, 34, dtype=torch.uint8)
    blocks[:, :, 0:2] = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)
    rows = torch.arange(cols)
    blocks[rows, rows // 32, 2 + rows % 32] = 1
    weight = QuantizedWeight("q8_0", cols, cols, blocks.view(cols, -1).contiguous())
    gen = torch.Generator().manual_seed(5)
    x = (torch.randint(-127, 128, (37, cols), generator=gen) / 64.0).bfloat16()
    x[3, :32] = torch.tensor([2.0, 1.0, -1.0, 0.5] * 8)
    x[4] = 0.0
    want, _ = quantized_activations(x, "q8_0")
    for m in (1, 37):
        assert torch.equal(kernel.dots_f32(x[:m], weight), want[:m]), m


def test_int8_dots_are_exact_on_every_path(library):
    """W8A8 sums integers exactly, so every ISA gives the same float32 logits bit for bit, and
    they equal the torch computation on the kernel's own int8 activations."""
    gen = torch.Generator().manual_seed(3)
    weight = quantize_int8(torch.randn(70, 1000, generator=gen))
    x = torch.randn(5, 1000, generator=gen).bfloat16()
    results = {}
    for isa in ISA_CODES:
        kernel = QuantLinearKernel(library, ISA_CODES[isa])
        if kernel.isa == ISA_CODES[isa]:
            results[isa] = kernel.dots_f32(x, weight)
    assert len(results) >= 1
    first = next(iter(results.values()))
    for isa, got in results.items():
        assert torch.equal(got, first), isa
    xq, _ = quantized_activations(x, INT8)
    want = xq.double() @ weight.dequantize(torch.float32).double().T
    assert torch.allclose(first.double(), want, rtol=1e-5, atol=1e-4)


# weight row counts that leave partial tiles (16 rows) and partial groups of 4 rows
_BATCH_CASES = [("q4_0", 37, 576), ("q4_1", 40, 576), ("q8_0", 37, 576), ("q4_k", 21, 512),
                ("q5_k", 24, 512), ("q6_k", 21, 768), (INT8, 40, 1000), (FP8_BLOCK, 140, 1000)]


@pytest.mark.parametrize("isa", ["portable", "avx2", "avx512"])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(library, isa):
    """Speculative verification rows must equal the same position decoded alone: each input
    row's output is bit-identical whether it is computed alone, among 2..8 rows (decode), or
    among 9..301 (prefill: tiles of unpacked weight rows, pairs of input rows, odd counts), in
    any order."""
    kernel = _kernel(library, isa)
    gen = torch.Generator().manual_seed(11)
    for fmt, rows, cols in _BATCH_CASES:
        weight = random_blocks(fmt, rows, cols, gen)
        x = torch.randn(301, cols, generator=gen).bfloat16()
        alone = torch.cat([kernel.dots_f32(x[i:i + 1], weight) for i in range(301)])
        for m in (2, 3, 4, 5, 8, 9, 13, 67, 130, 301):
            assert torch.equal(kernel.dots_f32(x[:m], weight), alone[:m]), (fmt, m)
        perm = torch.randperm(301, generator=gen)
        assert torch.equal(kernel.dots_f32(x[perm], weight), alone[perm]), fmt


@pytest.mark.parametrize("isa", ["portable", "avx2", "avx512"])
def test_prefill_rows_equal_the_chunked_path_on_any_number_of_threads(library, isa):
    """Hundreds of rows, tiles on and off, 1 and 2 threads (the weight rows split between
    them), bf16 outputs with a bias and float32 dots: all bit-identical, and equal to
    torch on the kernel's int8 activations up to float32 summation order."""
    kernel = _kernel(library, isa)
    gen = torch.Generator().manual_seed(13)
    old_threads = torch.get_num_threads()
    try:
        for fmt, rows, cols in _BATCH_CASES:
            weight = random_blocks(fmt, rows, cols, gen)
            x = torch.randn(203, cols, generator=gen).bfloat16()
            bias = torch.randn(rows, generator=gen).bfloat16()
            runs = {}
            for threads in (1, 2):
                torch.set_num_threads(threads)
                for tiles in (True, False):
                    kernel.prefill_tiles = tiles
                    runs[threads, tiles] = (kernel.linear(x, weight, bias), kernel.dots_f32(x, weight))
            first = runs[1, True]
            for key, (out, dots) in runs.items():
                assert torch.equal(out, first[0]) and torch.equal(dots, first[1]), (fmt, key)
            xq, step = quantized_activations(x, weight.format)
            w = weight.dequantize(torch.float32)
            want = xq.double() @ w.double().T
            tol = 1e-5 * (xq.abs().double() @ w.abs().double().T) + 1.01 * step[:, None].double() * w.abs().amax(dim=1).double()
            assert ((first[1].double() - want).abs() <= tol).all(), fmt
    finally:
        torch.set_num_threads(old_threads)
        kernel.prefill_tiles = True


@pytest.mark.parametrize("isa", ["portable", "avx2", "avx512"])
def test_float32_rows_are_exact_and_independent_of_the_batch(library, isa):
    """The float32 (exact) path tiles weight rows and pairs input rows: each row's output is
    bit-identical alone or among others (odd counts, partial tiles, a K with a tail), and equals
    x @ dequantize(W).T up to float32 summation order."""
    kernel = _kernel(library, isa)
    gen = torch.Generator().manual_seed(12)
    for fmt, rows, cols in [("q4_1", 37, 576), ("q6_k", 21, 512), (INT8, 19, 1003),
                            (FP8_BLOCK, 35, 1000)]:
        weight = random_blocks(fmt, rows, cols, gen)
        x = torch.randn(23, cols, generator=gen)
        alone = torch.cat([kernel.linear(x[i:i + 1], weight, None) for i in range(23)])
        for m in (2, 3, 7, 23):
            assert torch.equal(kernel.linear(x[:m], weight, None), alone[:m]), (fmt, m)
        want = x.double() @ weight.dequantize(torch.float32).double().T
        assert torch.allclose(alone.double(), want, rtol=1e-5, atol=1e-4), fmt


# prefill-tile edges: one block per row (K = 32) and two, weight rows below one group of 4,
# a partial group and a partial tile, input row counts that leave every tail of a pass
_TILE_EDGE_CASES = [(fmt, n, k) for fmt in ("q4_0", "q4_1", "q8_0") for n, k in
                    ((1, 32), (3, 64), (6, 32), (17, 96), (35, 64))]
_TILE_EDGE_CASES += [("q4_k", 5, 256), ("q6_k", 18, 256)]


@pytest.mark.parametrize("isa", ["portable", "avx2", "avx512"])
def test_prefill_tile_edges_equal_the_rows_alone(library, isa):
    """Every input row of a prefill-sized batch (9..42 rows, tiles on and off) gives the bits
    of the same row computed alone (the decode path), for bf16 outputs with and without a
    bias (tails of fewer than 4 weight rows are stored one by one, whole groups four at once)
    and for float32 dots."""
    kernel = _kernel(library, isa)
    gen = torch.Generator().manual_seed(17)
    try:
        for fmt, rows, cols in _TILE_EDGE_CASES:
            weight = random_blocks(fmt, rows, cols, gen)
            x = torch.randn(42, cols, generator=gen).bfloat16()
            bias = torch.randn(rows, generator=gen).bfloat16()
            for b in (None, bias):
                alone = torch.cat([kernel.linear(x[i:i + 1], weight, b) for i in range(42)])
                dots = torch.cat([kernel.dots_f32(x[i:i + 1], weight) for i in range(42)])
                for tiles in (True, False):
                    kernel.prefill_tiles = tiles
                    for m in (9, 10, 11, 12, 13, 42):
                        case = (fmt, rows, cols, b is not None, tiles, m)
                        assert torch.equal(kernel.linear(x[:m], weight, b), alone[:m]), case
                        assert torch.equal(kernel.dots_f32(x[:m], weight), dots[:m]), case
            xq, step = quantized_activations(x, weight.format)
            w = weight.dequantize(torch.float32)
            tol = 1e-5 * (xq.abs().double() @ w.abs().double().T) + 1.01 * step[:, None].double() * w.abs().amax(dim=1).double()
            assert ((dots.double() - xq.double() @ w.double().T).abs() <= tol).all(), fmt
    finally:
        kernel.prefill_tiles = True
