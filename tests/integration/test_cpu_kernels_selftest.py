"""Every C kernel is checked against torch at load; a wrong build falls back to torch.

The faults are real builds: a private copy of runtime/kernels/ with one line of a source
broken the way a miscompile or a tail-handling bug would break it, compiled and loaded
through the normal path into a private build cache.
"""
from __future__ import annotations

import logging
import shutil
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.layers.mlp import SwiGLUMLP
from deepinfer.layers.norm import RMSNorm
from deepinfer.runtime import cpu_kernel_build
from deepinfer.runtime.cpu_decode_kernel import load_decode_kernel, reference_decode
from deepinfer.runtime.cpu_elementwise_kernels import install_elementwise_kernels
from deepinfer.runtime.kv_cache import KVCacheSpec, PagedKVCache
from deepinfer.runtime.model_runner import ModelRunner

_LOGGER = "deepinfer.runtime.cpu_kernel_build"


@pytest.fixture
def kernel_sources(tmp_path, monkeypatch):
    """Private kernel sources, build cache and self-test verdicts; returns `break_source`."""
    sources = tmp_path / "kernels"
    shutil.copytree(cpu_kernel_build.KERNEL_DIR, sources)
    monkeypatch.setattr(cpu_kernel_build, "KERNEL_DIR", sources)
    monkeypatch.setattr(cpu_kernel_build, "_VERDICTS", {})
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("DEEPINFER_CPU_KERNELS", "1")
    monkeypatch.setenv("DEEPINFER_DECODE_KERNEL", "1")

    def break_source(name: str, old: str, new: str) -> None:
        path = sources / (name if name.endswith(".h") else f"{name}.c")  # a kernel or a header
        text = path.read_text()
        assert old in text, f"{old!r} is no longer in {path.name}: update this test's fault"
        path.write_text(text.replace(old, new))

    return break_source


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == _LOGGER and r.levelno == logging.WARNING]


def _decode_case(dtype):
    gen = torch.Generator().manual_seed(3)
    k_cache = torch.randn(20, 16, 2, 64, generator=gen).to(dtype)
    v_cache = torch.randn(20, 16, 2, 64, generator=gen).to(dtype)
    tables = torch.randperm(20, generator=gen)[:12].view(4, 3)
    lens = torch.tensor([1, 16, 17, 48])
    q = torch.randn(4, 8, 64, generator=gen).to(dtype)
    return q, k_cache, v_cache, tables, lens


def _runner(dtype):
    spec = KVCacheSpec(num_layers=1, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype)
    model = SimpleNamespace(config=SimpleNamespace(num_attention_heads=8))
    return ModelRunner(model, PagedKVCache(spec, 4, torch.device("cpu")), torch.device("cpu"))


def test_correct_decode_kernel_passes_its_self_test(kernel_sources, caplog):
    """Positive control: the unbroken copy loads for both dtypes and the runner uses it."""
    kernel = load_decode_kernel()
    assert kernel is not None
    assert kernel.supports(torch.bfloat16, torch.device("cpu"))
    assert kernel.supports(torch.float32, torch.device("cpu"))
    assert _runner(torch.bfloat16).decode_kernel is not None
    assert _warnings(caplog) == []


def test_wrong_bf16_decode_kernel_falls_back_to_torch(kernel_sources, caplog):
    # One wrong lane of every widened bf16 row: what the Zen 4 strict-aliasing bug did, smaller.
    kernel_sources("paged_decode_attention", "dst[i] = bf16_to_f32(src[i]);",
                   "dst[i] = bf16_to_f32(src[i]) * (i == 5 ? 2.f : 1.f);")
    kernel = load_decode_kernel()
    assert kernel is not None and kernel.supports(torch.float32, torch.device("cpu"))
    assert not kernel.supports(torch.bfloat16, torch.device("cpu"))
    assert _runner(torch.bfloat16).decode_kernel is None  # bf16 models keep gather + SDPA
    # the fp32 half still agrees with torch
    case = _decode_case(torch.float32)
    got = kernel(*case, torch.get_num_threads())
    assert torch.allclose(got, reference_decode(*case), atol=1e-4, rtol=1e-4)
    load_decode_kernel()  # a second load does not test or warn again
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and "paged_decode_attention_bf16" in warnings[0], warnings


def test_wrong_decode_kernel_in_every_dtype_is_not_used(kernel_sources, caplog):
    kernel_sources("paged_decode_attention", "qf[g][d] *= scale;", "qf[g][d] *= scale * 1.5f;")
    assert load_decode_kernel() is None
    assert _runner(torch.float32).decode_kernel is None
    assert len(_warnings(caplog)) == 2  # one per dtype


def _norm_and_mlp(width=577, inner=300):
    torch.manual_seed(0)
    model = nn.ModuleList([RMSNorm(width, 1e-6, torch.bfloat16),
                           SwiGLUMLP(width, inner, torch.bfloat16)])
    model[0].weight.data.normal_()
    for linear in (model[1].gate_up_proj, model[1].down_proj):
        linear.weight.data.normal_(0, 0.05)
    return model


def _forward(model, x):
    return model[1](model[0](x))


def test_correct_elementwise_kernels_pass_their_self_test(kernel_sources, caplog):
    model = _norm_and_mlp()
    assert install_elementwise_kernels(model) == 2
    assert model[0].cpu_kernels is not None and model[1].cpu_kernels is not None
    assert _warnings(caplog) == []


def test_wrong_elementwise_kernels_fall_back_and_outputs_stay_torch(kernel_sources, caplog):
    # RMSNorm drops the last element of odd rows from its sum; SiLU-and-mul leaves the
    # vector tail (widths not a multiple of 16) unwritten.
    kernel_sources("elementwise_bf16.h", "for (int i = 0; i < H; i++) {\n        const float v",
                   "for (int i = 0; i < (H & ~1); i++) {\n        const float v")
    kernel_sources("elementwise_bf16.h", "for (int i = 0; i < n; i++) dst[i] = f32_to_bf16",
                   "for (int i = 0; i < (n & ~15); i++) dst[i] = f32_to_bf16")
    model, reference = _norm_and_mlp(), _norm_and_mlp()
    assert install_elementwise_kernels(model) == 0
    assert model[0].cpu_kernels is None and model[1].cpu_kernels is None
    x = torch.randn(70, 577).bfloat16()
    assert torch.equal(_forward(model, x), _forward(reference, x))
    warnings = _warnings(caplog)
    assert len(warnings) == 2, warnings
    assert "rms_norm_bf16" in warnings[0] and "silu_and_mul_bf16" in warnings[1]


def test_one_wrong_elementwise_op_leaves_the_other_installed(kernel_sources, caplog):
    kernel_sources("elementwise_bf16.h", "for (int i = 0; i < n; i++) dst[i] = f32_to_bf16",
                   "for (int i = 0; i < (n & ~15); i++) dst[i] = f32_to_bf16")
    model = _norm_and_mlp()
    assert install_elementwise_kernels(model) == 1
    assert model[0].cpu_kernels is not None and model[1].cpu_kernels is None
    x = torch.randn(70, 577).bfloat16()
    normed = F.rms_norm(x.float(), (577,), model[0].weight.float(), 1e-6)
    assert torch.allclose(model[0](x).float(), normed, atol=1e-2, rtol=1e-2)
    assert len(_warnings(caplog)) == 1


def test_a_kernel_that_raises_in_its_self_test_is_not_used(kernel_sources, monkeypatch, caplog):
    from deepinfer.runtime.cpu_decode_kernel import DecodeKernel

    def fails(*args):
        raise RuntimeError("decode kernel failed (code 1)")

    monkeypatch.setattr(DecodeKernel, "__call__", fails)
    assert load_decode_kernel() is None
    assert "RuntimeError" in _warnings(caplog)[0]


def test_a_build_for_another_cpu_or_compiler_is_not_reused(kernel_sources, monkeypatch):
    """-march=native code from another host may be wrong or illegal here (shared home, copied
    cache): the CPU and the compiler are part of the cached library's name."""
    source = cpu_kernel_build.KERNEL_DIR / "fused_elementwise.c"
    here = cpu_kernel_build._build(source, "gcc")
    assert cpu_kernel_build._build(source, "gcc") == here  # the cache does work
    monkeypatch.setattr(cpu_kernel_build, "cpu_identity", lambda: "model name: another CPU")
    other_cpu = cpu_kernel_build._build(source, "gcc")
    monkeypatch.setattr(cpu_kernel_build, "compiler_identity", lambda compiler: "gcc 99.1")
    other_compiler = cpu_kernel_build._build(source, "gcc")
    assert len({here, other_cpu, other_compiler}) == 3
