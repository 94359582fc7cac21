"""Hostile frames across real network namespaces: a P1/D1 cluster (front and both workers) runs
in namespace "cluster" with every socket on its 10.x address (`--host`, `--cluster-host`); an
attacker process in namespace "attack" reaches it only over veth + bridge and throws garbage,
truncated, oversized, foreign-key, forged, replayed, wrongly typed, multi-part and pickled
frames at every listening TCP port while greedy requests run. The test process talks HTTP
through its own bridge port. Outputs must equal the same prompts' outputs before the attack,
no file may appear, drops are counted, and the server still answers."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

from deepinfer.wire.secret import SECRET_ENV, derive_key
from tests.integration.netns import NetnsTopology, require_netns
from tests.integration.serve_process import scrape_metrics

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SECRET = "netns-secret-" + os.urandom(8).hex()
DROPPED = "deepinfer:wire_frames_dropped_total"
HTTP_PORT = 8000  # the namespace is ours: no other listener can hold it
PROMPTS = ["Once upon a time, in a land far away, there lived a king who",
           "The three primary colours are", "def fibonacci(n):"]
REPO = Path(__file__).resolve().parents[2]


class NetnsServer:
    """`deepinfer serve` P1/D1 inside `member`'s namespace, bound to its address."""

    def __init__(self, topo: NetnsTopology, member: str) -> None:
        addr = topo.address(member)
        self.topo, self.member, self.addr = topo, member, addr
        self.url = f"http://{addr}:{HTTP_PORT}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="deepinfer-netns-", suffix=".log")
        argv = [sys.executable, "-m", "deepinfer.cli.main", "serve", "--host", addr,
                "--port", str(HTTP_PORT), "--cluster-host", addr, "--dtype", "float32",
                "--threads", "1", "--num-kv-blocks", "128", "--max-model-len", "256",
                "--prefill-workers", "1", "--decode-workers", "1"]
        env = {**os.environ, SECRET_ENV: SECRET, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(topo.exec_argv(member, argv), stdin=subprocess.DEVNULL,
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-4000:]

    def wait_ready(self, timeout_s: float = 400.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited ({self.proc.returncode}):\n{self.output()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"serve not ready after {timeout_s} s:\n{self.output()}")

    def listeners(self) -> list[str]:
        """tcp://ADDR:PORT of every port listening on the namespace's address (or any)."""
        out = subprocess.run(self.topo.exec_argv(self.member, ["ss", "-ltnH"]),
                             capture_output=True, text=True, check=True).stdout
        ports = set()
        for line in out.splitlines():
            local = line.split()[3]
            host, _, port = local.rpartition(":")
            if host in (self.addr, "0.0.0.0", "*", "[::]") and int(port) != HTTP_PORT:
                ports.add(int(port))
        return [f"tcp://{self.addr}:{p}" for p in sorted(ports)]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def cluster():
    require_netns()
    with NetnsTopology(("cluster", "attack"), root_port=True) as topo:
        server = NetnsServer(topo, "cluster")
        try:
            server.wait_ready()
            yield topo, server
        finally:
            code = server.stop()
        assert code == 0, f"server did not stop cleanly ({code}):\n{server.output()}"


def _complete(url: str, prompt: str, max_tokens: int = 16) -> list[int]:
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    r = httpx.post(f"{url}/v1/completions", timeout=180, json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True})
    r.raise_for_status()
    return r.json()["choices"][0]["token_ids"]


def _drops(url: str) -> float:
    return sum(v for k, v in scrape_metrics(url).items() if k.startswith(DROPPED + "{"))


def test_attacker_in_another_namespace_changes_no_answer(cluster, tmp_path):
    topo, server = cluster
    marker = tmp_path / "pwned"
    want = {p: _complete(server.url, p) for p in PROMPTS}  # unattacked reference
    endpoints = server.listeners()
    assert len(endpoints) >= 3, endpoints  # report PULL, 2 worker PUSHes, KV ROUTER
    drops_before = _drops(server.url)
    got: dict[str, list[int] | Exception] = {}

    def load() -> None:
        for p in PROMPTS:
            try:
                got[p] = _complete(server.url, p)
            except Exception as exc:  # reported below
                got[p] = exc

    requests = threading.Thread(target=load, daemon=True)
    requests.start()
    argv = [sys.executable, "-m", "tests.integration.netns_attacker",
            derive_key(SECRET).hex(), str(marker), "2", *endpoints]
    attacker = subprocess.run(topo.exec_argv("attack", argv), capture_output=True, text=True,
                              timeout=180, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert attacker.returncode == 0, attacker.stderr[-3000:]
    requests.join(300)
    assert got == want, server.output()
    deadline = time.monotonic() + 30
    while _drops(server.url) <= drops_before and time.monotonic() < deadline:
        time.sleep(0.3)
    assert _drops(server.url) > drops_before
    assert not marker.exists()
    assert {p: _complete(server.url, p) for p in PROMPTS} == want  # still serving, same tokens
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
