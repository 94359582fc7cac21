"""A speculative verification's rows (one sequence, consecutive positions, one block table)
computed together must give, row by row, the bits of the same positions decoded one at a
time: the C decode attention reads their K/V once for all of them (decode_rows_bf16_avx512,
_avx2) and the GEMV takes 5..8 rows with its own kernel (gemv_wide_bf16.h). Otherwise greedy
speculation would change bf16 outputs."""
from __future__ import annotations

import pytest
import torch

from deepinfer.runtime.cpu_decode_kernel import DecodeKernel
from deepinfer.runtime.cpu_decode_stack import DecodeStack, _random_model, load_decode_stack_library
from deepinfer.runtime.cpu_kernel_build import load_kernel_library


def _threads(n):
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    return previous


@pytest.mark.parametrize("num_kv_heads,group", [(3, 3), (2, 8), (1, 16)])
@pytest.mark.parametrize("num_threads", [1, 2])
def test_decode_attention_rows_of_one_sequence_equal_each_row_alone(num_kv_heads, group, num_threads):
    lib = load_kernel_library("paged_decode_attention")
    assert lib is not None, "the C compiler is part of the supported setup; the build failed"
    kernel = DecodeKernel(lib)
    gen = torch.Generator().manual_seed(num_kv_heads * 100 + group)
    head_dim, block_size, num_blocks, width = 64, 16, 60, 8
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).bfloat16()
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).bfloat16()
    order = torch.randperm(num_blocks, generator=gen)
    seq_a, seq_b, seq_c = order[:width], order[width:2 * width], order[2 * width:3 * width]
    # A plain decode, 7 verification rows of B (crossing a block boundary at 32; more rows than
    # fit one group of DECODE_MAX_G query heads when group > 4), a decode of C, 2 rows of A.
    rows = [(seq_a, 40)] + [(seq_b, 27 + i) for i in range(7)] + [(seq_c, 100)] + [
        (seq_a, 41), (seq_a, 42)]
    tables = torch.stack([t for t, _ in rows])
    lens = torch.tensor([n for _, n in rows])
    q = torch.randn(len(rows), num_kv_heads * group, head_dim, generator=gen).bfloat16()
    previous = _threads(num_threads)
    try:
        together = kernel(q, k_cache, v_cache, tables, lens, num_threads)
        for i in range(len(rows)):
            alone = kernel(q[i:i + 1], k_cache, v_cache, tables[i:i + 1], lens[i:i + 1], num_threads)
            assert torch.equal(together[i:i + 1], alone), (i, (together[i] - alone[0]).abs().max())
    finally:
        torch.set_num_threads(previous)


def _one_sequence_step(stack, cache_kv, ids, first_pos, table, block_size):
    """Run the stack over len(ids) consecutive positions of one sequence in one call."""
    from deepinfer.runtime.kv_cache import PagedKVCache
    from deepinfer.runtime.paged_attention import AttentionMetadata, DecodeMetadata, PagedAttention

    rows = len(ids)
    positions = torch.arange(first_pos, first_pos + rows)
    slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in positions.tolist()])
    block_ids = torch.tensor(table * rows)
    meta = AttentionMetadata(slots, DecodeMetadata(rows, block_ids, None, positions + 1), [])
    attn = PagedAttention(cache_kv, meta, 1)
    assert type(cache_kv) is PagedKVCache and stack.applies(torch.tensor(ids), attn)
    return stack(torch.tensor(ids), positions, attn)


@pytest.mark.parametrize("rows", [2, 5, 6, 8])
@pytest.mark.parametrize("num_threads", [1, 2])
def test_decode_stack_verification_rows_equal_the_positions_decoded_one_by_one(rows, num_threads):
    """The whole stack (GEMVs, attention, K/V writes) on a small random model: one call over
    `rows` positions vs `rows` calls of one position each."""
    from deepinfer.runtime.kv_cache import KVCacheSpec, PagedKVCache

    lib = load_decode_stack_library()
    if lib is None:  # AVX-512 / AVX2 code: on other CPUs the engine stays on the per-op path
        flags = open("/proc/cpuinfo").read().split()
        assert "avx512f" not in flags and not ("avx2" in flags and "fma" in flags), \
            "AVX-512 / AVX2 host: the stack must build"
        pytest.skip("no AVX-512 or AVX2 + FMA on this host: the fused decode stack is off")
    gen = torch.Generator().manual_seed(rows)
    # hidden 160 (one 128-wide block and a 32-wide tail), GQA 3, intermediate 300
    model = _random_model(160, 6, 2, 64, 300, True, gen)
    stack = DecodeStack(lib, model.model)
    block_size = 4
    spec = KVCacheSpec(2, 2, 64, block_size, torch.bfloat16)
    cache = PagedKVCache(spec, 30, torch.device("cpu"))
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=gen))
    table = torch.randperm(30, generator=gen)[:12].tolist()
    ids = torch.randint(0, 50, (rows,), generator=gen).tolist()
    first_pos = 21
    previous = _threads(num_threads)
    try:
        with torch.inference_mode():
            one_by_one = PagedKVCache(spec, 30, torch.device("cpu"))
            one_by_one.kv.copy_(cache.kv)
            together = _one_sequence_step(stack, cache, ids, first_pos, table, block_size)
            alone = torch.cat([_one_sequence_step(stack, one_by_one, ids[i:i + 1], first_pos + i,
                                                  table, block_size) for i in range(rows)])
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(together, alone), (together.float() - alone.float()).abs().max()
    assert torch.equal(cache.kv, one_by_one.kv)
