"""CUDA attention backend (runtime/cuda_attention.py) and CUDA-graph decode runner
(runtime/cuda_graphs.py) against the plain PagedAttention path.

The SDPA path and the static-buffer decode path are device-agnostic, so they are checked on
CPU here; the `gpu` tests repeat them on CUDA, with graphs captured and FlashInfer when it is
installed (they are skipped without CUDA)."""
from __future__ import annotations

import pytest
import torch

from deepinfer.runtime.cuda_attention import CudaAttentionBuilder, CudaPagedAttention
from deepinfer.runtime.cuda_graphs import CudaGraphDecodeRunner
from deepinfer.runtime.kv_cache import KVCacheSpec, PagedKVCache
from deepinfer.runtime.paged_attention import (AttentionMetadata, DecodeMetadata, PagedAttention,
                                               PrefillChunkMetadata)

BS = 4  # block size
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 16
# (request blocks, tokens already in the cache, new tokens this step): three decodes of
# different lengths, a prefill chunk without prefix and one after a 6-token prefix.
REQUESTS = [([3, 7, 1], 9, 1), ([5], 2, 1), ([10, 11, 12, 13], 13, 1), ([20, 21, 22], 0, 9),
            ([14, 15, 16], 6, 5)]

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _cache(device, num_layers: int = 1, seed: int = 0, dtype=torch.float32,
           head_dim: int = HEAD_DIM) -> PagedKVCache:
    spec = KVCacheSpec(num_layers, NUM_KV_HEADS, head_dim, BS, dtype)
    cache = PagedKVCache(spec, 48, torch.device(device))
    gen = torch.Generator().manual_seed(seed)
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=gen).to(dtype))
    return cache


def _plain_metadata(device) -> AttentionMetadata:
    """The runner's metadata for REQUESTS (decodes first), built as ModelRunner builds it."""
    dev = torch.device(device)
    slots, decode_tables, decode_lens, prefills, start = [], [], [], [], 0
    for blocks, p0, x in REQUESTS:
        slots += [blocks[p // BS] * BS + p % BS for p in range(p0, p0 + x)]
        if x == 1:
            decode_tables.append(blocks[:-(-(p0 + 1) // BS)])
            decode_lens.append(p0 + 1)
        elif p0 == 0:
            prefills.append(PrefillChunkMetadata(start, x, 0, None, None))
        else:
            ids = torch.tensor(blocks[:-(-(p0 + x) // BS)], device=dev)
            keys = torch.arange(p0 + x, device=dev)[None]
            mask = keys <= torch.arange(p0, p0 + x, device=dev)[:, None]
            prefills.append(PrefillChunkMetadata(start, x, p0, ids, mask))
        start += x
    width = max(map(len, decode_tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in decode_tables], device=dev)
    lens = torch.tensor(decode_lens, device=dev)
    mask = torch.arange(width * BS, device=dev)[None] < lens[:, None]
    decode = DecodeMetadata(len(decode_tables), table.view(-1), mask[:, None, None, :], lens)
    return AttentionMetadata(torch.tensor(slots, device=dev), decode, prefills)


def _qkv(device, seed: int = 1, dtype=torch.float32, head_dim: int = HEAD_DIM):
    num_tokens = sum(x for _, _, x in REQUESTS)
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(num_tokens, h, head_dim, generator=gen).to(device, dtype)
            for h in (NUM_HEADS, NUM_KV_HEADS, NUM_KV_HEADS)]


def _check_same_as_plain(device, backend_of, dtype=torch.float32, tol: float = 1e-5,
                         head_dim: int = HEAD_DIM) -> None:
    q, k, v = _qkv(device, dtype=dtype, head_dim=head_dim)
    plain_cache = _cache(device, dtype=dtype, head_dim=head_dim)
    cache = _cache(device, dtype=dtype, head_dim=head_dim)
    meta = _plain_metadata(device)
    expected = PagedAttention(plain_cache, meta, NUM_HEADS).forward(0, q, k, v)
    got = backend_of(cache, meta).forward(0, q, k, v)
    assert torch.equal(cache.kv, plain_cache.kv)  # the same slots written
    assert (got.float() - expected.float()).abs().max().item() < tol


def test_sdpa_path_equals_paged_attention_on_a_mixed_batch():
    _check_same_as_plain("cpu", lambda cache, meta: CudaPagedAttention(cache, meta, NUM_HEADS))


def _tiny_llama(device):
    from deepinfer.models.llama import LlamaForCausalLM
    from deepinfer.models.model_config import ModelConfig
    from tests.integration.tiny_models import tiny_hf_model

    hf = tiny_hf_model("llama")
    model = LlamaForCausalLM(ModelConfig.from_hf_config(hf.config.to_dict()), torch.float32)
    model.load_weights(hf.state_dict().items())
    return model.to(device)


def _decode_batch(device, num: int, seed: int = 2):
    """`num` decodes over distinct blocks with context lengths 1..(4 blocks)."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 4 * BS + 1, (num,), generator=gen)
    table = torch.arange(num * 4).view(num, 4) + 1  # block 0 stays free (capture's slot)
    pos = lens - 1
    slots = table.gather(1, (pos // BS)[:, None])[:, 0] * BS + pos % BS
    ids = torch.randint(3, 256, (num,), generator=gen)
    return [t.to(device) for t in (ids, pos, slots, table, lens)]


def _plain_decode(model, cache, ids, pos, slots, table, lens):
    width = table.shape[1]
    mask = torch.arange(width * BS, device=lens.device)[None] < lens[:, None]
    meta = AttentionMetadata(slots, DecodeMetadata(len(ids), table.reshape(-1),
                                                   mask[:, None, None, :], lens), [])
    return model(ids, pos, PagedAttention(cache, meta, NUM_HEADS))


def _check_graph_runner(device, capture: bool) -> None:
    model = _tiny_llama(device)
    plain_cache, cache = _cache(device, 2), _cache(device, 2)
    runner = CudaGraphDecodeRunner(model, cache, NUM_HEADS, max_blocks_per_seq=6,
                                   batch_sizes=(1, 4, 8), capture_graphs=capture)
    runner.capture()
    cache.kv.copy_(plain_cache.kv)  # undo the warm-up's writes to slot 0
    for num in (3, 1, 8):  # padded into bucket 4, exact bucket 1, exact bucket 8
        batch = _decode_batch(device, num, seed=num)
        expected = _plain_decode(model, plain_cache, *batch)
        got = runner.run(*batch)
        assert got.shape == expected.shape
        assert (got - expected).abs().max().item() < 1e-4, num
        # Padding rows write only row 0's slot (layer 1's K/V may differ in the last bits:
        # another batch size, another GEMM blocking).
        assert (cache.kv - plain_cache.kv).abs().max().item() < 1e-5, num
    with pytest.raises(ValueError, match="exceeds the captured"):
        runner.run(*_decode_batch(device, 9))
    # From the runner's own metadata: decode-only steps that fit go through the graphs.
    mixed = _plain_metadata(device)
    assert not runner.can_run(mixed)  # has prefill chunks
    ids, pos, slots, table, lens = _decode_batch(device, 2, seed=5)
    width = table.shape[1]
    mask = torch.arange(width * BS, device=device)[None] < lens[:, None]
    meta = AttentionMetadata(slots, DecodeMetadata(2, table.reshape(-1), mask[:, None, None, :],
                                                   lens), [])
    assert runner.can_run(meta)
    expected = _plain_decode(model, plain_cache, ids, pos, slots, table, lens)
    assert (runner.run_step(ids, pos, meta) - expected).abs().max().item() < 1e-4


def test_static_decode_path_equals_plain_decode_with_padding_buckets():
    _check_graph_runner("cpu", capture=False)


def test_graph_runner_rejects_graphs_without_cuda():
    with pytest.raises(ValueError, match="CUDA"):
        CudaGraphDecodeRunner(torch.nn.Identity(), _cache("cpu"), NUM_HEADS, 4,
                              capture_graphs=True)


@pytest.mark.gpu
@needs_cuda
def test_cuda_sdpa_path_equals_paged_attention():
    _check_same_as_plain("cuda", lambda cache, meta: CudaPagedAttention(cache, meta, NUM_HEADS))


@pytest.mark.gpu
@needs_cuda
def test_cuda_flashinfer_path_equals_paged_attention():
    pytest.importorskip("flashinfer")
    builders = []

    def backend_of(cache, meta):
        builders.append(CudaAttentionBuilder(cache, NUM_HEADS))  # picks FlashInfer for bf16
        return builders[-1].build(meta)

    _check_same_as_plain("cuda", backend_of, torch.bfloat16, tol=3e-2, head_dim=64)
    assert builders[0].workspace is not None


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_decode_equals_plain_decode():
    _check_graph_runner("cuda", capture=True)


@pytest.mark.gpu
@needs_cuda
def test_runner_on_cuda_selects_the_cuda_backend():
    from deepinfer.runtime.model_runner import ModelRunner
    model = _tiny_llama("cuda")
    runner = ModelRunner(model, _cache("cuda", 2), torch.device("cuda"))
    backend = runner._attention_backend(_plain_metadata("cuda"))
    assert isinstance(backend, CudaPagedAttention)


@pytest.mark.gpu
@pytest.mark.slow
@needs_cuda
def test_engine_on_cuda_matches_cpu_greedy_and_profiles_gpu_time(engine_base_llm, tmp_path):
    """The whole engine on CUDA (runner hook -> CudaPagedAttention; chunked prefill exercises the
    cached-prefix path) against the session's CPU fp32 engine; --profile's GPU column."""
    from deepinfer import LLM, SamplingParams
    from deepinfer.runtime.step_trace import StepTrace

    cuda_llm = LLM(model=None, dtype="float32", device="cuda", kv_cache_memory="1GiB", seed=0,
                   max_num_batched_tokens=64)
    prompts = [{"prompt_token_ids": list(range(300 + i, 300 + i + n))}
               for i, n in enumerate((5, 40, 130))]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    runner = cuda_llm.engine.runner
    trace = StepTrace(str(tmp_path), decode_steps=2, decode_warmup=1, device=torch.device("cuda"))
    runner.execute = trace.wrap(runner.execute)
    try:
        got = cuda_llm.generate(prompts, params, use_tqdm=False)
    finally:
        del runner.execute
    expected = engine_base_llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert isinstance(runner.cuda_attention, CudaAttentionBuilder)  # the hook built the backend
    windows = {w.name: w for w in trace.close()}
    assert any(r.get("self_device_us", 0.0) > 0 for r in windows["decode"].ops)
