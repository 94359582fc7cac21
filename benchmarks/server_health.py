"""Waiting for a benchmarked server (DeepInfer's or a peer's) to answer /health with 200."""
from __future__ import annotations

import subprocess
import time
import urllib.request


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float, name: str = "server") -> None:
    """Poll `url`/health until it answers 200; RuntimeError if `proc` exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.25)  # polling interval of a bounded wait, not synchronisation
    raise RuntimeError(f"{name} not healthy after {timeout_s} s")
