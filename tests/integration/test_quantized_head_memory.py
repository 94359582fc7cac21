"""A quantized model keeps one copy of its bf16 LM head (untied `lm_head`, or the tied
embedding table): resident bf16 bytes equal the checkpoint's bf16 tensors exactly, while a
bf16 model still gets its packed copies; and the one-copy head computes the logits of the
plain weight at decode-sized and larger row counts.

Hosts without oneDNN's bf16 weight packing (AVX2-only: it needs AVX-512 or AVX-NE-CONVERT)
never made the second copy, so packing is simulated there with a real extra copy of each
weight, which is what oneDNN's reorder keeps."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from deepinfer.models.quantized_model import weight_bytes_by_format
from deepinfer.runtime import cpu_linear_packing
from deepinfer.runtime.cpu_small_batch_linear import load_small_batch_linear
from deepinfer.runtime.model_source import load_model, resolve_model
from tests.integration.fp8_checkpoints import fp8_hf_model, write_fp8_pair

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """tied -> (fp8 dir, dequantized fp32 dir, bf16 bytes of the FP8 checkpoint)."""
    out = {}
    for tied in (False, True):
        model = fp8_hf_model("qwen3_aligned", seed=7)
        if tied:
            model.config.tie_word_embeddings = True
            model.tie_weights()
        root = tmp_path_factory.mktemp(f"fp8_head_tied{int(tied)}")
        fp8_dir, ref_dir = str(root / "fp8"), str(root / "ref")
        write_fp8_pair(model, fp8_dir, ref_dir)
        tensors = load_file(os.path.join(fp8_dir, "model.safetensors"))
        assert ("lm_head.weight" in tensors) != tied
        bf16 = sum(t.numel() * 2 for t in tensors.values() if t.dtype == torch.bfloat16)
        out[tied] = (fp8_dir, ref_dir, bf16)
    return out


@pytest.fixture
def packing(monkeypatch):
    """oneDNN packing as on an AVX-512 host: a packed layer holds a second copy."""
    small_batch = load_small_batch_linear()
    if small_batch is None:
        pytest.skip("no small-batch kernel: no one-copy head to test")
    probe = cpu_linear_packing._try_pack(torch.nn.Linear(8, 8, bias=False, dtype=torch.bfloat16))
    if not cpu_linear_packing._ops_available() or getattr(probe, "packed_weight", None) is None:
        def fake_pack(linear):
            return cpu_linear_packing.PackedLinear(linear, linear.weight.detach().clone(), small_batch)
        monkeypatch.setattr(cpu_linear_packing, "_ops_available", lambda: True)
        monkeypatch.setattr(cpu_linear_packing, "_try_pack", fake_pack)


def _load(path: str):
    model = load_model(resolve_model(path), torch.bfloat16)
    cpu_linear_packing.pack_linear_weights(model)
    return model


@pytest.mark.parametrize("tied", [False, True])
def test_quantized_model_keeps_one_copy_of_its_head(checkpoints, packing, tied):
    fp8_dir, ref_dir, bf16_bytes = checkpoints[tied]
    assert weight_bytes_by_format(_load(fp8_dir))["bfloat16"] == bf16_bytes
    # the same packing on a bf16 model does keep second copies (so the check above can fail)
    dense = weight_bytes_by_format(_load(ref_dir))
    assert dense["bfloat16"] > 2 * bf16_bytes


@pytest.mark.parametrize("tied", [False, True])
def test_one_copy_head_logits_match_the_plain_weight(checkpoints, tied):
    """1..8 rows through the small-batch kernel (float32 dots), more through F.linear with
    the exact top-k recompute: the plain weight's logits, the same greedy tokens."""
    model = _load(checkpoints[tied][0])
    weight = model.logits_weight()
    assert weight is not None and weight.dtype == torch.bfloat16
    gen = torch.Generator().manual_seed(1)
    for rows in (1, 3, 8, 20):
        hidden = torch.randn(rows, weight.shape[1], generator=gen).bfloat16()
        got = model.compute_logits(hidden)
        want = F.linear(hidden.float(), weight.float())
        assert torch.equal(got.argmax(-1), want.argmax(-1)), rows
        assert torch.allclose(got, want, rtol=2 ** -7, atol=2 ** -7 * want.abs().max().item()), rows
