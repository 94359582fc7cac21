"""Builds and calls the C paged-decode-attention kernel (kernels/paged_decode_attention.c).

The kernel reads K/V straight from the block table, so decode attention skips the gather
copy. It is compiled once per source version and machine with the host C compiler into
~/.cache/deepinfer/kernels and loaded with ctypes; if no compiler is found or the build
fails, `load_decode_kernel()` returns None and attention stays on the torch path.
Set DEEPINFER_DECODE_KERNEL=0 to force the torch path.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "kernels" / "paged_decode_attention.c"
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-shared"]
_ARGTYPES = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int]


class DecodeKernel:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fns = {torch.bfloat16: lib.paged_decode_attention_bf16,
                     torch.float32: lib.paged_decode_attention_f32}
        for fn in self._fns.values():
            fn.argtypes = _ARGTYPES
            fn.restype = ctypes.c_int

    def supports(self, dtype: torch.dtype, device: torch.device) -> bool:
        return device.type == "cpu" and dtype in self._fns

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 tables: torch.Tensor, lens: torch.Tensor, num_threads: int) -> torch.Tensor:
        """q [B, H, d] contiguous; caches [blocks, bs, KV, d]; tables [B, W]; lens [B]."""
        num, num_heads, head_dim = q.shape
        _, block_size, num_kv_heads, _ = k_cache.shape
        out = torch.empty_like(q)
        rc = self._fns[q.dtype](
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
            lens.data_ptr(), out.data_ptr(), num, num_kv_heads, num_heads // num_kv_heads,
            head_dim, block_size, tables.shape[1], head_dim ** -0.5, num_threads)
        if rc != 0:
            raise RuntimeError(f"decode kernel failed (code {rc})")
        return out


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "deepinfer" / "kernels"


def _build(compiler: str) -> Path:
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join([compiler, *_FLAGS, os.uname().machine]).encode())
    target = _cache_dir() / f"paged_decode_attention-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    subprocess.run([compiler, *_FLAGS, str(_SOURCE), "-o", tmp, "-lm"], check=True,
                   capture_output=True, timeout=120)
    os.replace(tmp, target)  # atomic: concurrent builders never load half a file
    return target


def load_decode_kernel() -> DecodeKernel | None:
    if os.environ.get("DEEPINFER_DECODE_KERNEL", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        logger.info("no C compiler found: decode attention uses the torch path")
        return None
    try:
        return DecodeKernel(ctypes.CDLL(str(_build(compiler))))
    except (OSError, subprocess.SubprocessError, AttributeError) as e:
        logger.warning("decode kernel unavailable (%s): using the torch path", e)
        return None
