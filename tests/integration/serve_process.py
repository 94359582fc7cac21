"""A real `deepinfer serve` process on 127.0.0.1 for integration tests, and /metrics helpers."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


# A small server for robustness tests: any valid request generates at most ~60 tokens.
SMALL_SERVER_ARGS = ("--dtype", "float32", "--kv-cache-memory", "64MiB", "--threads", "1",
                     "--max-model-len", "64", "--max-num-seqs", "8",
                     "--max-waiting-requests", "0", "--enable-prompt-tokens-details")
# Its engine raises inside the step for a request with this seed (step_faults.DebugStepFault).
SMALL_SERVER_FAULT_SEED = 31337
SMALL_SERVER_ENV = {"DEEPINFER_DEBUG_STEP_FAULT_SEED": str(SMALL_SERVER_FAULT_SEED)}


# /admin/* exist only with --enable-admin-api and a key.
ADMIN_KEY = "test-admin-key"
ADMIN_FLAGS = ("--enable-admin-api", "--admin-api-key", ADMIN_KEY)
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN_KEY}"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """`deepinfer serve ARGS --port <free>`; `wait_ready()` blocks until /health is 200.

    `prefix` runs the command under another (e.g. `ip netns exec NS`) and `host`/`port` are
    where the server listens and is reached (the caller then passes `--host HOST` in ARGS when
    it is not 127.0.0.1; `port` defaults to a free one of this namespace)."""

    def __init__(self, *args: str, env: dict[str, str] | None = None,
                 prefix: list[str] | tuple[str, ...] = (), host: str = "127.0.0.1",
                 port: int | None = None) -> None:
        self.host = host
        self.port = port if port is not None else free_port()
        self.url = f"http://{host}:{self.port}"
        script = Path(sys.executable).with_name("deepinfer")
        command = ([str(script)] if script.exists()
                   else [sys.executable, "-m", "deepinfer.cli.main"])
        self.log = tempfile.NamedTemporaryFile("w+", prefix="deepinfer-serve-", suffix=".log")
        self.proc = subprocess.Popen(
            [*prefix, *command, "serve", "--port", str(self.port), *args],
            stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})})

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-4000:]

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"deepinfer serve exited ({self.proc.returncode}):\n"
                                   f"{self.output()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"deepinfer serve not ready after {timeout_s} s:\n{self.output()}")

    def engine_pid(self, timeout_s: float = 60.0) -> int:
        """The pid of the colocated engine process (the server's one `spawn` child); polls
        while it is being (re)started."""
        import psutil

        deadline = time.monotonic() + timeout_s
        while True:
            for child in psutil.Process(self.proc.pid).children():
                try:
                    if "spawn_main" in " ".join(child.cmdline()) and child.status() != \
                            psutil.STATUS_ZOMBIE:
                        return child.pid
                except psutil.NoSuchProcess:
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"no engine process under the server:\n{self.output()}")
            time.sleep(0.1)

    def stop(self) -> int:
        """Ctrl-C, as a user would; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        return self.proc.returncode


@contextlib.contextmanager
def running_server(*args: str, env: dict[str, str] | None = None):
    """A ready `ServeProcess(*args)` for a fixture to yield; stopped with Ctrl-C at the end,
    which must exit cleanly."""
    server = ServeProcess(*args, env=env)
    try:
        server.wait_ready()
        yield server
    finally:
        code = server.stop()
    assert code == 0, f"server did not stop cleanly ({code})"


def scrape_metrics(url: str) -> dict[str, float]:
    """Prometheus text → {'name{labels}': value} (sample lines only)."""
    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def metric(samples: dict[str, float], name: str) -> float:
    """Sum of every sample of `name` (over label sets)."""
    return sum(v for k, v in samples.items() if k.split("{", 1)[0] == name)


def wait_for_metric(url: str, name: str, predicate, timeout_s: float = 60.0) -> float:
    deadline = time.monotonic() + timeout_s
    while True:
        value = metric(scrape_metrics(url), name)
        if predicate(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.2)


class OfflineReference:
    """The session's offline fp32 LLM, run on one thread like the servers under test (same
    kernels, and on a busy 2-core machine one thread is several times faster)."""

    def __init__(self, llm) -> None:
        self.llm = llm

    def _run(self, method, *args):
        import torch

        num_threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return method(*args, use_tqdm=False)
        finally:
            torch.set_num_threads(num_threads)

    def chat(self, messages, params):
        return self._run(self.llm.chat, messages, params)[0]

    def generate(self, prompts, params):
        return self._run(self.llm.generate, prompts, params)
