"""Start a private `redis-server` for a test run (free port on 127.0.0.1, no persistence).

Usage: `with running_redis_server() as url: ...`. Fails (does not skip) when redis-server is
missing: CI installs it (`make system-deps`).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_redis_server(startup_timeout_s: float = 10.0) -> Iterator[str]:
    """Yields `redis://127.0.0.1:<port>/0`; stops the server afterwards."""
    binary = shutil.which("redis-server") or next(
        (p for p in ("/usr/bin/redis-server", "/usr/local/bin/redis-server") if os.path.exists(p)),
        None)
    if binary is None:
        pytest.fail("redis-server not found: install it (apt-get install redis-server, "
                    "or `make system-deps`); the redis tests start their own server")
    import redis

    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--protected-mode", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        client = redis.Redis.from_url(url, socket_timeout=1)
        deadline = time.monotonic() + startup_timeout_s
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    err = proc.stderr.read().decode(errors="replace") if proc.poll() is not None else ""
                    pytest.fail(f"redis-server did not start on port {port}: {err.strip()}")
                time.sleep(0.05)
        client.close()
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
