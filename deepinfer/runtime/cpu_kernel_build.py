"""Builds the small C kernels in runtime/kernels/ with the host compiler, loads them, and
checks them against torch before anyone uses them.

Each source is one translation unit (it may include the kernels/*.h headers) and is
compiled once per (source and headers, compiler version, flags, CPU) into
~/.cache/deepinfer/kernels (atomic rename, so concurrent processes never load half a file)
and loaded with ctypes. The CPU's identity is in the file name because the build uses
-march=native: a library built on another CPU (a shared home directory, a copied cache)
could use instructions this one lacks, or be tuned into code that is wrong here. No
compiler or a failed build returns None: callers keep the torch path.
DEEPINFER_CPU_KERNELS=0 disables every kernel.

`self_test` runs a kernel's comparison against torch once per process and library; a
mismatch logs one warning and the caller keeps the torch path, so a kernel that is right on
one CPU and wrong on another is never a silent wrong answer.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

KERNEL_DIR = Path(__file__).parent / "kernels"
# -ffast-math only when compiling: linking with it would add crtfastmath.o, which turns on
# flush-to-zero for the whole process at load time (hypothesis, for one, refuses to run then).
# -fno-strict-aliasing: the kernels rely on `restrict`, not on type-based alias analysis, and
# bf16 bit tricks that break the aliasing rule were once miscompiled (see the kernel sources).
_COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fno-strict-aliasing", "-fopenmp",
                  "-fPIC"]
_LINK_FLAGS = ["-shared", "-fopenmp"]
# /proc/cpuinfo fields that say which instructions -march=native may use (x86, then arm).
_CPU_FIELDS = ("vendor_id", "cpu family", "model", "model name", "flags",
               "CPU implementer", "CPU architecture", "CPU variant", "CPU part", "Features")


def kernels_enabled() -> bool:
    return os.environ.get("DEEPINFER_CPU_KERNELS", "1") != "0"


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "deepinfer" / "kernels"


@functools.lru_cache(maxsize=1)
def cpu_identity() -> str:
    """The first processor's model and feature flags (what -march=native resolves from)."""
    try:
        first = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    fields = [line for line in first.splitlines() if line.split(":")[0].strip() in _CPU_FIELDS]
    return "\n".join(fields) or f"{platform.machine()} {platform.processor()}"


@functools.lru_cache(maxsize=8)
def compiler_identity(compiler: str) -> str:
    """Resolved path and `--version` text: a compiler upgrade rebuilds every kernel."""
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    return f"{shutil.which(compiler) or compiler}\n{version}"


def _build(source_path: Path, compiler: str) -> Path:
    source = source_path.read_bytes()
    # Every header beside the source is part of the key: an edited header rebuilds.
    headers = [h.name.encode() + b"\0" + h.read_bytes()
               for h in sorted(source_path.parent.glob("*.h"))]
    key = hashlib.sha256(b"\0".join([
        source, *headers, " ".join([*_COMPILE_FLAGS, *_LINK_FLAGS]).encode(),
        compiler_identity(compiler).encode(), os.uname().machine.encode(),
        cpu_identity().encode()]))
    target = _cache_dir() / f"{source_path.stem}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    obj = tmp[:-3] + ".o"
    try:
        subprocess.run([compiler, *_COMPILE_FLAGS, "-c", str(source_path), "-o", obj],
                       check=True, capture_output=True, timeout=120)
        subprocess.run([compiler, *_LINK_FLAGS, obj, "-o", tmp, "-lm"], check=True,
                       capture_output=True, timeout=120)
        os.replace(tmp, target)
    finally:
        for path in (tmp, obj):
            if os.path.exists(path):
                os.unlink(path)
    return target


def load_kernel_library(name: str) -> ctypes.CDLL | None:
    """Compile (if needed) and load kernels/<name>.c; None when unavailable."""
    if not kernels_enabled():
        return None
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        logger.info("no C compiler found: %s stays on the torch path", name)
        return None
    try:
        return ctypes.CDLL(str(_build(KERNEL_DIR / f"{name}.c", compiler)))
    except (OSError, subprocess.SubprocessError) as e:
        logger.warning("C kernel %s unavailable (%s): using the torch path", name, e)
        return None


def bind_per_dtype(lib: ctypes.CDLL, symbols: dict, dtypes, argtypes: list) -> dict:
    """{dtype: the library's entry point for it}, each typed `argtypes` -> int (status)."""
    fns = {dtype: getattr(lib, symbols[dtype]) for dtype in dtypes}
    for fn in fns.values():
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
    return fns


_VERDICTS: dict[tuple[str, str], bool] = {}


def self_test(lib: ctypes.CDLL, what: str, check: Callable[[], str | None]) -> bool:
    """True when `check` (which returns a mismatch description, or None) passes. Runs once
    per process for each library file and `what`; a failure logs one warning."""
    key = (lib._name, what)
    if key not in _VERDICTS:
        try:
            problem = check()
        except Exception as e:  # a kernel that cannot run is as bad as a wrong one
            problem = f"{type(e).__name__}: {e}"
        if problem is not None:
            logger.warning("C kernel %s disagrees with torch on this host (%s): using the "
                           "torch path", what, problem)
        _VERDICTS[key] = problem is None
    return _VERDICTS[key]


def mismatch(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float,
             case: str) -> str | None:
    """None when `got` matches `want` elementwise (NaN counts as a mismatch), else why not."""
    if got.shape != want.shape:
        return f"{case}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    got, want = got.float(), want.float()
    bad = ~torch.isclose(got, want, rtol=rtol, atol=atol)
    if not bad.any():
        return None
    error = (got - want).abs().nan_to_num(nan=float("inf")).max().item()
    return f"{case}: {int(bad.sum())} of {got.numel()} values off, max error {error:.3g}"
