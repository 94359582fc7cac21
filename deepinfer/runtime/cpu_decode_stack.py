"""The whole decoder stack of a dense bf16 Llama-family model for a decode-only step of 1..8 rows,
in one C call (kernels/decode_stack.c).

At batch 1 the per-op path spends about as much CPU in Python and torch's dispatch (~12 ops per
layer) as in its weight reads; one call per step removes that. `install_decode_stack(model)`
collects each layer's weight descriptors once (runtime/cpu_stack_weights.py: bf16 weights --
after weight packing, the small-batch GEMV's plain copies -- or quantized ones in any format of
the weight contract, no new copy) and sets `model.model.decode_stack`; `LlamaModel.forward` hands a
step to it when `DecodeStack.applies` (a PagedAttention step whose rows are all decode rows, at
most 8 of them, no input embeddings). DEEPINFER_DECODE_STACK=0 keeps the per-op path.

The stack runs the same kernels with the same roundings as the per-op path, so its hidden
states are bit-equal to that path's whenever the per-op path runs those kernels too (rows the
per-op path sends to oneDNN instead of the C GEMV differ by bf16 rounding). At load it is
checked against the plain torch path of small random models (GQA groups, head dims, bias on and
off, 1 and N threads); a mismatch keeps the per-op path (cpu_kernel_build.self_test).
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os

import torch
from torch import Tensor, nn

from deepinfer.runtime.cpu_kernel_build import load_kernel_library, mismatch, self_test
from deepinfer.runtime.cpu_stack_weights import (quantize_modules_for_test, slot_descriptors,
                                                 tensors_of)

logger = logging.getLogger(__name__)

MAX_ROWS = 8  # the kernel's STACK_MAX_ROWS
_P, _INT, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
_ARGTYPES = [_P, _P, _P, _F, _F, _P, _P, _P, _P, _P, _P, _P, _P, _INT, _INT, _P, _I64, _INT, _P,
             _INT, _INT]
# (hidden, heads, kv heads, head dim, intermediate, bias): GQA groups 1/2/4, head dims 16-128,
# intermediate sizes below, at and past the 256-wide SiLU chunk.
_SELF_TEST_SHAPES = [(64, 4, 2, 16, 96, True), (96, 6, 3, 32, 256, False),
                     (128, 2, 1, 64, 300, True), (256, 2, 2, 128, 520, False)]
# Quantized models: (shape, formats of qkv q|k, qkv v, o, gate_up, down, embedding); a qkv of
# two formats is two parts; widths of whole 32- / 256-value blocks, partial fp8 tiles.
_QUANT_SELF_TESTS = [((64, 4, 2, 16, 96, True), ("q4_1", "q8_0", "q4_0", "q4_1", "q8_0", "q8_0")),
                     ((256, 2, 2, 128, 512, False), ("q4_k", "q6_k", "q5_k", "q4_k", "q6_k", "q4_k")),
                     ((96, 6, 3, 16, 160, True), ("int8", "int8", "fp8_block", "int8", "fp8_block",
                                                  "q8_0"))]
_SELF_TEST_TOL = 5e-2  # the per-op torch path rounds in other places (oneDNN, SDPA)
_QUANT_SELF_TEST_ATOL = 3e-2


def enabled() -> bool:
    return os.environ.get("DEEPINFER_DECODE_STACK", "1") != "0"


def _ptr(tensor: Tensor | None) -> int:
    return 0 if tensor is None else tensor.data_ptr()


class DecodeStack:
    """One model's layer pointers and the C entry point; call with a decode-only step."""

    def __init__(self, lib: ctypes.CDLL, model: nn.Module, isa: int = 0) -> None:
        """`model`: a LlamaModel whose layers `stack_unsupported` accepted; `isa`: the quantized
        GEMVs' instruction set (the per-op quantized kernel's, so both compute alike)."""
        self._fn = lib.decode_stack_bf16
        self._fn.argtypes = _ARGTYPES
        self._fn.restype = _INT
        self._isa = isa
        layers = model.layers
        attn0 = layers[0].self_attn
        self.num_kv_heads, self.head_dim = attn0.num_kv_heads, attn0.head_dim
        self.hidden = model.embed_tokens.embedding_dim
        rows, slots, self._keep = [], [], []  # _keep: every tensor a pointer of the tables names
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            tensors = [layer.input_layernorm.weight, attn.qkv_proj.bias, attn.o_proj.bias,
                       layer.post_attention_layernorm.weight]
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            self._keep.extend(t for t in tensors if t is not None)
            self._keep.extend(t for m in linears for t in tensors_of(m))
            rows.append([_ptr(t) for t in tensors])
            slots.append(torch.stack([slot_descriptors(m) for m in linears]))
        self._layer_ptrs = torch.tensor(rows, dtype=torch.int64)
        self._weight_descs = torch.stack(slots).contiguous()  # [L, 4, parts, 8]
        self._dims = torch.tensor([len(layers), self.hidden, attn0.num_heads, self.num_kv_heads,
                                   self.head_dim, layers[0].mlp.intermediate_size,
                                   model.embed_tokens.num_embeddings,
                                   model.rotary.cos_sin_cache.shape[0]], dtype=torch.int32)
        self._embed_desc = slot_descriptors(model.embed_tokens)[0].contiguous()
        self._keep.extend(tensors_of(model.embed_tokens))
        self._norm = model.norm.weight
        self._eps = model.norm.eps
        self._scale = self.head_dim ** -0.5
        self._cos_sin = model.rotary.cos_sin_cache
        self.rows_run: list[int] = []  # rows of each step run, the last few (tests, profiling)

    def applies(self, input_ids: Tensor, attn) -> bool:
        """A PagedAttention step whose rows are all decode rows (at most MAX_ROWS), over a
        bf16 per-head K/V cache shaped like this model's."""
        from deepinfer.runtime.kv_cache import PagedKVCache
        from deepinfer.runtime.paged_attention import PagedAttention

        if type(attn) is not PagedAttention:
            return False
        meta = attn.meta
        if meta.prefills or meta.decode is None or not 1 <= meta.decode.num_tokens <= MAX_ROWS:
            return False
        cache = attn.cache
        return (type(cache) is PagedKVCache and cache.kv.dtype == torch.bfloat16
                and cache.kv.device.type == "cpu" and cache.kv.is_contiguous()
                and cache.spec.num_kv_heads == self.num_kv_heads
                and cache.spec.head_dim == self.head_dim
                and input_ids.shape[0] == meta.decode.num_tokens)

    def __call__(self, input_ids: Tensor, positions: Tensor, attn) -> Tensor:
        """input_ids/positions [R] -> final-normed hidden [R, hidden]; writes the step's K/V."""
        meta, cache = attn.meta, attn.cache
        decode = meta.decode
        num = decode.num_tokens
        ids, positions = input_ids.contiguous(), positions.contiguous()
        slots, tables, lens = meta.slot_mapping, decode.block_ids, decode.context_lens
        out = torch.empty(num, self.hidden, dtype=torch.bfloat16)
        rc = self._fn(self._layer_ptrs.data_ptr(), self._weight_descs.data_ptr(),
                      self._dims.data_ptr(), self._eps, self._scale, self._embed_desc.data_ptr(),
                      self._norm.data_ptr(), self._cos_sin.data_ptr(), ids.data_ptr(),
                      positions.data_ptr(), slots.data_ptr(), tables.data_ptr(), lens.data_ptr(),
                      num, tables.numel() // num, cache.kv.data_ptr(), cache.num_blocks,
                      cache.spec.block_size, out.data_ptr(), torch.get_num_threads(), self._isa)
        if rc == 3:
            raise IndexError("decode stack: a token id, position, slot or block id is out of range")
        if rc != 0:
            raise RuntimeError(f"decode stack kernel failed (code {rc})")
        self.rows_run.append(num)
        del self.rows_run[:-64]
        return out


def stack_unsupported(lib: ctypes.CDLL, model: nn.Module) -> str | None:
    """Why the stack cannot run LlamaModel `model` (None when it can)."""
    from deepinfer.layers.mlp import SwiGLUMLP

    layers = getattr(model, "layers", None)
    if not layers:
        return "no layers"
    if model.norm.weight.dtype != torch.bfloat16 or model.norm.weight.device.type != "cpu":
        return "not a bf16 CPU model"
    if slot_descriptors(model.embed_tokens) is None:
        return "an embedding table the stack cannot read"
    cos_sin = model.rotary.cos_sin_cache
    if cos_sin.dtype != torch.bfloat16 or not cos_sin.is_contiguous():
        return "rotary table is not contiguous bf16"
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        if type(mlp) is not SwiGLUMLP:
            return "not a dense SwiGLU MLP (MoE)"
        if getattr(attn, "q_norm", None) is not None:
            return "q/k norm"
        if not hasattr(attn, "qkv_proj") or attn.num_heads % attn.num_kv_heads:
            return "not GQA attention"
        if any(slot_descriptors(m) is None for m in (attn.qkv_proj, attn.o_proj,
                                                     mlp.gate_up_proj, mlp.down_proj)):
            return "a linear keeps no plain bf16 weight, or has parts the kernels do not take"
        if any(getattr(m, "kernel", True) is None for m in (attn.qkv_proj, attn.o_proj,
                                                            mlp.gate_up_proj, mlp.down_proj)):
            return "a quantized linear without its verified kernel"
        if any(b is not None and (b.dtype != torch.bfloat16 or not b.is_contiguous())
               for b in (attn.qkv_proj.bias, attn.o_proj.bias)):
            return "a bias is not contiguous bf16"
        if layer.input_layernorm.eps != model.norm.eps or layer.post_attention_layernorm.eps != model.norm.eps:
            return "norms with different eps"
    attn0 = layers[0].self_attn
    if not lib.decode_stack_supported(attn0.num_heads // attn0.num_kv_heads, attn0.head_dim):
        return "head shape unsupported by this build (needs AVX-512 with head_dim % 16 == 0, or AVX2 + FMA with head_dim % 8 == 0)"
    return None


# --- self-test: the stack against the plain torch path of small random models ---

def _random_model(hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int, bias: bool,
                  gen: torch.Generator):
    from deepinfer.models.llama import LlamaForCausalLM
    from deepinfer.models.model_config import ModelConfig

    config = ModelConfig(architecture="qwen2" if bias else "llama", vocab_size=50,
                         hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=head_dim, rms_norm_eps=1e-6, rope_theta=10000.0,
                         rope_scaling=None, max_position_embeddings=256,
                         tie_word_embeddings=True, attention_bias=bias, qk_norm=False,
                         bos_token_id=None, eos_token_ids=())
    model = LlamaForCausalLM(config, torch.bfloat16)
    for name, p in model.named_parameters():
        scale = 0.2 if name.endswith("norm.weight") else (0.5 if name.endswith("bias") else
                                                           p.shape[-1] ** -0.5)
        p.copy_((1.0 if name.endswith("norm.weight") else 0.0)
                + scale * torch.randn(p.shape, generator=gen))
    return model


def _decode_step(model, gen: torch.Generator, rows: int, block_size: int = 4):
    """A cache holding random context and a decode-only step of `rows` rows: two sequences
    with one row each, the rest verification rows of a third (consecutive positions)."""
    from deepinfer.runtime.kv_cache import KVCacheSpec, PagedKVCache
    from deepinfer.runtime.paged_attention import AttentionMetadata, DecodeMetadata

    cfg = model.config
    spec = KVCacheSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, block_size,
                       torch.bfloat16)
    cache = PagedKVCache(spec, 40, torch.device("cpu"))
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=gen))
    order = torch.randperm(40, generator=gen).tolist()
    lens = [1, 9][:rows] + [23 + i for i in range(max(0, rows - 2))]  # new tokens included
    seq_tables = [order[0:1], order[1:4], order[4:12]]
    tables = [seq_tables[min(i, 2)] for i in range(rows)]
    width = max(len(t) for t in tables)
    ctx = torch.arange(width * block_size)
    context_lens = torch.tensor(lens)
    positions = context_lens - 1
    slots = torch.tensor([t[p // block_size] * block_size + p % block_size
                          for t, p in zip(tables, positions.tolist())])
    block_ids = torch.tensor([t + [0] * (width - len(t)) for t in tables]).view(-1)
    mask = (ctx[None, :] < context_lens[:, None])[:, None, None, :]
    meta = AttentionMetadata(slots, DecodeMetadata(rows, block_ids, mask, context_lens), [])
    ids = torch.randint(0, cfg.vocab_size, (rows,), generator=gen)
    return cache, meta, ids, positions


def _self_test_models(gen: torch.Generator, isa: int | None):
    """(name, model) for each self-test case: the bf16 shapes, then (when the quantized kernel
    loaded, `isa` not None) the quantized ones."""
    for shape in _SELF_TEST_SHAPES:
        yield str(shape), shape, _random_model(*shape, gen)
    if isa is None:
        return
    from deepinfer.runtime.cpu_quant_linear import install_quant_kernels
    for shape, formats in _QUANT_SELF_TESTS:
        model = _random_model(*shape, gen)
        quantize_modules_for_test(model, formats, gen)
        if not install_quant_kernels(model):
            return
        yield f"{shape} {'/'.join(formats)}", shape, model


def _atol(model, want: Tensor) -> float:
    """bf16 models: _SELF_TEST_TOL. Quantized ones also round activations to int8, where the
    per-op path's torch norms and attention (other bf16 roundings) move a code now and then:
    _QUANT_SELF_TEST_ATOL of the largest value (a wrong kernel is off by O(1) of it)."""
    from deepinfer.models.quantized_model import quantized_modules

    if not quantized_modules(model):
        return _SELF_TEST_TOL
    return max(_SELF_TEST_TOL, _QUANT_SELF_TEST_ATOL * want.float().abs().max().item())


def decode_stack_mismatch(lib: ctypes.CDLL, isa: int | None = None) -> str | None:
    """First disagreement of the stack with the plain torch path (hidden states and the K/V it
    writes), or None. `isa`: also check quantized models with the quantized kernel's ISA."""
    from deepinfer.runtime.paged_attention import PagedAttention

    gen = torch.Generator().manual_seed(0)
    old_threads = torch.get_num_threads()
    try:
        for name, shape, model in _self_test_models(gen, isa):
            problem = stack_unsupported(lib, model.model)
            if problem is not None:
                return f"{name}: {problem}"
            stack = DecodeStack(lib, model.model, isa or 0)
            for rows in (1, 3, MAX_ROWS):
                cache, meta, ids, positions = _decode_step(model, gen, rows)
                want_cache = _clone_cache(cache)
                want = model.model(ids, positions, PagedAttention(want_cache, meta, shape[1]))
                for num_threads in sorted({1, old_threads}):
                    torch.set_num_threads(num_threads)
                    got_cache = _clone_cache(cache)
                    attn = PagedAttention(got_cache, meta, shape[1])
                    if not stack.applies(ids, attn):
                        return f"{name}, rows={rows}: the stack does not apply"
                    case = f"decode stack {name}, rows={rows}, threads={num_threads}"
                    got = stack(ids, positions, attn)
                    problem = (mismatch(got, want, _SELF_TEST_TOL, _atol(model, want), case)
                               or mismatch(got_cache.kv, want_cache.kv, _SELF_TEST_TOL,
                                           _atol(model, want_cache.kv), case + " (K/V written)"))
                    if problem is not None:
                        return problem
                torch.set_num_threads(old_threads)
    finally:
        torch.set_num_threads(old_threads)
    return None


def _clone_cache(cache):
    from deepinfer.runtime.kv_cache import PagedKVCache

    copy = PagedKVCache(cache.spec, cache.num_blocks, cache.kv.device)
    copy.kv.copy_(cache.kv)
    return copy


def _quant_isa() -> int | None:
    """The verified quantized kernel's ISA, or None when it is unavailable."""
    from deepinfer.runtime.cpu_quant_linear import load_quant_linear

    kernel = load_quant_linear()
    return None if kernel is None else kernel.isa


@functools.lru_cache(maxsize=4)
def _verified_library(isa: int | None) -> ctypes.CDLL | None:
    lib = load_kernel_library("decode_stack")
    if lib is None:
        return None
    lib.decode_stack_supported.argtypes = [_INT, _INT]
    lib.decode_stack_supported.restype = _INT
    with torch.inference_mode():
        ok = self_test(lib, f"decode_stack_bf16[quantized isa {isa}]",
                       lambda: decode_stack_mismatch(lib, isa))
    return lib if ok else None


def load_decode_stack_library() -> ctypes.CDLL | None:
    """The verified library, or None (disabled, no compiler, or it disagrees with torch)."""
    if not enabled():
        return None
    return _verified_library(_quant_isa())


def install_decode_stack(model: nn.Module) -> bool:
    """Give a bf16 CPU dense Llama-family `model` (LlamaForCausalLM) the fused decode stack;
    True when installed. Call after weight packing (the stack points at the plain weights)
    and after the quantized layers got their kernels (runtime.cpu_quant_linear)."""
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "decode_stack") or not enabled():
        return False
    lib = load_decode_stack_library()
    if lib is None:
        return False
    problem = stack_unsupported(lib, inner)
    if problem is not None:
        logger.info("decode stack not used: %s", problem)
        return False
    inner.decode_stack = DecodeStack(lib, inner, _quant_isa() or 0)
    return True
