"""The netns fixture itself: real traffic crosses the bridge, cut drops it, heal restores it,
and teardown leaves no namespace behind (also when the body raises)."""
from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from tests.integration.netns import NetnsTopology, netns_names, require_netns

pytestmark = pytest.mark.slow

# Listens on ADDR:PORT in one namespace, answers one line per connection.
_SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 7411)); s.listen(); print("ready", flush=True)
while True:
    c, _ = s.accept(); c.sendall(b"pong\\n"); c.close()
"""
_CLIENT = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], 7411), timeout=float(sys.argv[2])) as c:
        print(c.recv(16).decode().strip())
except OSError as exc:
    print("fail", type(exc).__name__)
"""


@pytest.fixture
def topo():
    require_netns()
    with NetnsTopology(("front", "worker", "attack"), root_port=True) as t:
        yield t


def _connect(topo: NetnsTopology, src: str, dst: str, timeout_s: float = 2.0) -> str:
    argv = topo.exec_argv(src, [sys.executable, "-c", _CLIENT, topo.address(dst),
                                str(timeout_s)])
    return subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout.strip()


def test_traffic_crosses_namespaces_cut_and_heal(topo):
    server = subprocess.Popen(topo.exec_argv("worker", [sys.executable, "-c", _SERVER,
                                                        topo.address("worker")]),
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        assert _connect(topo, "front", "worker") == "pong"
        assert _connect(topo, "attack", "worker") == "pong"
        # The worker's address is not one of the root namespace's own.
        assert f"{topo.address('worker')}/" not in subprocess.run(
            ("ip", "-o", "addr"), capture_output=True, text=True).stdout
        with socket.create_connection((topo.address("worker"), 7411), timeout=5) as c:
            assert c.recv(16) == b"pong\n"  # the test process, through its root port
        topo.cut("worker")
        assert _connect(topo, "front", "worker", timeout_s=1.0).startswith("fail")
        topo.heal("worker")
        assert _connect(topo, "front", "worker") == "pong"
    finally:
        server.kill()
        server.wait()


def test_teardown_removes_namespaces_even_on_failure():
    require_netns()
    t = NetnsTopology(("a", "b"), root_port=True)
    with pytest.raises(ZeroDivisionError):
        with t:
            made = {t.hub, t.ns("a"), t.ns("b")}
            assert made <= netns_names()
            1 / 0
    assert not (made & netns_names())
    links = subprocess.run(("ip", "-o", "link"), capture_output=True, text=True).stdout
    assert f"dr{t.tag}" not in links  # the root namespace's port went with the hub


def test_bad_members_rejected_and_nothing_left():
    require_netns()
    t = NetnsTopology(("a", "a"))
    with pytest.raises(ValueError):
        t.open()
    assert not any(n.startswith(f"di{t.tag}") for n in netns_names())
