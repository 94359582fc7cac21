"""Builds the small C kernels in runtime/kernels/ with the host compiler and loads them.

Each source is compiled once per (source, compiler, flags, machine) into
~/.cache/deepinfer/kernels (atomic rename, so concurrent processes never load half a file)
and loaded with ctypes. No compiler or a failed build returns None: callers keep the torch
path. DEEPINFER_CPU_KERNELS=0 disables every kernel.
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

logger = logging.getLogger(__name__)

KERNEL_DIR = Path(__file__).parent / "kernels"
# -ffast-math only when compiling: linking with it would add crtfastmath.o, which turns on
# flush-to-zero for the whole process at load time (hypothesis, for one, refuses to run then).
_COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC"]
_LINK_FLAGS = ["-shared", "-fopenmp"]


def kernels_enabled() -> bool:
    return os.environ.get("DEEPINFER_CPU_KERNELS", "1") != "0"


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "deepinfer" / "kernels"


def _build(source_path: Path, compiler: str) -> Path:
    source = source_path.read_bytes()
    key = hashlib.sha256(source + " ".join([compiler, *_COMPILE_FLAGS, *_LINK_FLAGS,
                                            os.uname().machine]).encode())
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
