"""The C paged decode-attention kernel against the torch gather + SDPA path."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deepinfer.runtime.cpu_decode_kernel import DecodeKernel
from deepinfer.runtime.cpu_kernel_build import load_kernel_library


def _reference(q, k_cache, v_cache, tables, lens):
    num, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    k = k_cache.index_select(0, tables.view(-1)).view(num, -1, num_kv_heads, head_dim)
    v = v_cache.index_select(0, tables.view(-1)).view(num, -1, num_kv_heads, head_dim)
    mask = (torch.arange(k.shape[1]) < lens[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(
        q.view(num, num_kv_heads, -1, head_dim).float(), k.transpose(1, 2).float(),
        v.transpose(1, 2).float(), attn_mask=mask)
    return out.reshape(num, num_heads, head_dim)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("num_kv_heads,group", [(3, 3), (2, 1), (1, 8)])
def test_kernel_matches_gather_and_sdpa(dtype, tol, num_kv_heads, group):
    lib = load_kernel_library("paged_decode_attention")
    assert lib is not None, "the C compiler is part of the supported setup; the build failed"
    kernel = DecodeKernel(lib)
    gen = torch.Generator().manual_seed(num_kv_heads * 10 + group)
    num, head_dim, block_size, num_blocks, width = 7, 64, 16, 50, 6
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    # Random, non-contiguous block tables; lengths from 1 token to the full width.
    tables = torch.randperm(num_blocks, generator=gen)[:num * width].view(num, width)
    lens = torch.tensor([1, 2, 15, 16, 17, 50, width * block_size])
    q = torch.randn(num, num_kv_heads * group, head_dim, generator=gen).to(dtype)
    got = kernel(q, k_cache, v_cache, tables, lens, torch.get_num_threads())
    want = _reference(q, k_cache, v_cache, tables, lens)
    assert got.dtype == dtype and got.shape == q.shape
    assert torch.allclose(got.float(), want, atol=tol, rtol=tol), (got.float() - want).abs().max()


@pytest.mark.parametrize("num_tokens", [1, 63, 64, 300])
def test_fused_elementwise_kernels_match_torch(num_tokens):
    from deepinfer.runtime.cpu_elementwise_kernels import ElementwiseKernels

    lib = load_kernel_library("fused_elementwise")
    assert lib is not None, "the C compiler is part of the supported setup; the build failed"
    kernels = ElementwiseKernels(lib)
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, 576, generator=gen).bfloat16()
    weight = torch.randn(576, generator=gen).bfloat16()
    want = F.rms_norm(x.float(), (576,), weight.float(), 1e-5)
    got = kernels.rms_norm(x, weight, 1e-5)
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), want, rtol=1e-2, atol=1e-2)
    gate_up = torch.randn(num_tokens, 2 * 1536, generator=gen).bfloat16()
    gate, up = gate_up.float().split(1536, dim=-1)
    got = kernels.silu_and_mul(gate_up)
    assert torch.allclose(got.float(), F.silu(gate) * up, rtol=1e-2, atol=1e-2)


def test_loading_the_kernels_keeps_ieee_subnormals():
    """Linking with -ffast-math would switch the process to flush-to-zero at load time."""
    import ctypes

    for name in ("paged_decode_attention", "fused_elementwise"):
        assert load_kernel_library(name) is not None
    tiny = ctypes.c_double(2.2250738585072014e-308)  # smallest normal double
    assert tiny.value / 2 != 0.0, "subnormals are flushed to zero after loading the kernels"


def test_silu_and_mul_saturates_for_large_negative_gates():
    """silu(g) -> -0 as g -> -inf; under -ffast-math an overflowed expf came out as NaN."""
    from deepinfer.runtime.cpu_elementwise_kernels import ElementwiseKernels

    lib = load_kernel_library("fused_elementwise")
    assert lib is not None, "the C compiler is part of the supported setup; the build failed"
    gate = torch.tensor([-1000.0, -200.0, -100.0, -89.0, -88.0, -20.0, 0.0, 20.0, 100.0, 1000.0])
    gate = gate.repeat(4)[:37]  # odd width: a vector tail as well as full vectors
    gate_up = torch.cat([gate, torch.full_like(gate, 3.0)]).bfloat16()[None].repeat(20, 1)
    got = ElementwiseKernels(lib).silu_and_mul(gate_up).float()
    want = F.silu(gate_up[:, :37].float()) * 3.0
    assert not got.isnan().any()
    assert torch.allclose(got, want, rtol=1e-2, atol=1e-2), (got - want).abs().max()
