"""`deepinfer serve` inside a NetnsTopology member for the hostile-network tests: a
ServeProcess run under `ip netns exec`, every socket on the member's 10.x address, plus the
helpers those tests share (its listening ports, greedy completions, dropped-frame counts, the
attacker run from another member while requests run)."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from deepinfer.wire.secret import SECRET_ENV, derive_key
from tests.integration.netns import NetnsTopology
from tests.integration.serve_process import scrape_metrics, ServeProcess

DROPPED = "deepinfer:wire_frames_dropped_total"
HTTP_PORT = 8000  # the namespace is ours: no other listener can hold it
REPO = Path(__file__).resolve().parents[2]
SECRET = "netns-secret-" + os.urandom(8).hex()


def netns_server(topo: NetnsTopology, member: str, *args: str,
                 env: dict[str, str] | None = None) -> ServeProcess:
    """`deepinfer serve ARGS` in `member`'s namespace on its address (HTTP and cluster
    sockets), with the session's cluster secret; not yet waited for."""
    addr = topo.address(member)
    return ServeProcess("--host", addr, "--cluster-host", addr, *args,
                        prefix=topo.exec_argv(member, []), host=addr, port=HTTP_PORT,
                        env={SECRET_ENV: SECRET, "PYTHONPATH": str(REPO), **(env or {})})


def listeners(topo: NetnsTopology, member: str) -> list[str]:
    """tcp://ADDR:PORT of every port but HTTP listening on `member`'s address (or any)."""
    addr = topo.address(member)
    out = subprocess.run(topo.exec_argv(member, ["ss", "-ltnH"]), capture_output=True,
                         text=True, check=True).stdout
    ports = set()
    for line in out.splitlines():
        host, _, port = line.split()[3].rpartition(":")
        if host in (addr, "0.0.0.0", "*", "[::]") and int(port) != HTTP_PORT:
            ports.add(int(port))
    return [f"tcp://{addr}:{p}" for p in sorted(ports)]


def complete(url: str, prompt: str, max_tokens: int = 16, timeout_s: float = 180) -> list[int]:
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    r = httpx.post(f"{url}/v1/completions", timeout=timeout_s, json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True})
    r.raise_for_status()
    return r.json()["choices"][0]["token_ids"]


def drops(url: str) -> float:
    return sum(v for k, v in scrape_metrics(url).items() if k.startswith(DROPPED + "{"))


def attack_under_load(topo: NetnsTopology, attacker: str, endpoints: list[str], marker: Path,
                      load, rounds: int = 2) -> dict:
    """Run `load()` (returns {key: answer}) in a thread while the attacker process in
    `attacker`'s namespace hits every endpoint; {key: answer or exception}."""
    got: dict = {}

    def run() -> None:
        try:
            got.update(load())
        except Exception as exc:  # reported by the caller's comparison
            got["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    argv = [sys.executable, "-m", "tests.integration.netns_attacker",
            derive_key(SECRET).hex(), str(marker), str(rounds), *endpoints]
    res = subprocess.run(topo.exec_argv(attacker, argv), capture_output=True, text=True,
                         timeout=180, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 0, res.stderr[-3000:]
    # Worker inputs are ROUTERs that send only to a proven worker: a stray takes no share.
    assert "stray frames received: 0" in res.stdout, res.stdout[-3000:]
    thread.join(300)
    assert not thread.is_alive(), "requests under attack did not finish"
    return got


def wait_for_drops(url: str, above: float, timeout_s: float = 30) -> float:
    deadline = time.monotonic() + timeout_s
    while (value := drops(url)) <= above and time.monotonic() < deadline:
        time.sleep(0.3)
    return value
