"""A real Ray cluster across NetnsTopology members: `ray start --head` inside one namespace and
`ray start --address HEAD` inside others, each node on its member's 10.x address, so Ray's
control traffic and the actors' sockets cross the veths like separate hosts'.

What Ray needs to run in a namespace on this box: loopback up (NetnsTopology does it; the
dashboard agent listens on 127.0.0.1 too), `--node-ip-address` (no default route: Ray's probe
of 8.8.8.8 fails and it falls back to the hostname's address, which is not the member's), and
one private, short `--temp-dir` per node (its AF_UNIX sockets must stay within 107 bytes; the
plasma store is in /dev/shm, shared by the namespaces but named per node). Nothing else: the
raylets start their worker processes inside their own namespace.

Ray's ports are pinned (`RAY_PORTS`, and `WORKER_PORTS` for every driver's and worker's gRPC
server), so a test can tell them from DeepInfer's. Ray's processes on the head also hold a few
ports Ray gives no flag for (the autoscaler monitor's and log monitor's metrics servers); those
processes are no DeepInfer process, which is how `ray_listeners` knows them.

Teardown never runs `ray stop`: it kills every Ray process *on the machine* by name (other
sessions' clusters too). `close()` kills the processes inside this cluster's namespaces by pid
(`ip netns pids`), then removes the temp dirs."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.integration.netns import NetnsTopology

RAY = str(Path(sys.executable).with_name("ray"))
GCS_PORT = 6379
WORKER_PORTS = range(20000, 20100)
RAY_PORTS = {"--node-manager-port": 20100, "--object-manager-port": 20101,
             "--metrics-export-port": 20102, "--dashboard-agent-listen-port": 20103,
             "--dashboard-agent-grpc-port": 20104, "--runtime-env-agent-port": 20105}
CLIENT_SERVER_PORT = 20106  # head only
# Memory monitor off: it SIGKILLs workers when the shared *machine* nears full memory. The
# GCS declares a node dead after threshold x period of missed health checks; a dead node's
# raylet exits when it comes back, so a cut test must heal before that (~60 s here).
RAY_ENV = {"RAY_memory_monitor_refresh_ms": "0", "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_health_check_failure_threshold": "20"}
OBJECT_STORE_BYTES = 100 << 20
START_ATTEMPTS = 3


def is_ray_port(port: int) -> bool:
    return port == GCS_PORT or port == CLIENT_SERVER_PORT or port in WORKER_PORTS or \
        port in RAY_PORTS.values()


class NetnsRay:
    """A Ray head in `head` (no CPUs) and one node per entry of `nodes`
    ({member: (num_cpus, custom resources)}); `address` is the head's GCS."""

    def __init__(self, topo: NetnsTopology, head: str, nodes: dict[str, tuple[int, dict]]):
        self.topo, self.head, self.nodes = topo, head, nodes
        self.temp_dirs: list[str] = []

    @property
    def address(self) -> str:
        return f"{self.topo.address(self.head)}:{GCS_PORT}"

    @property
    def members(self) -> list[str]:
        return [self.head, *self.nodes]

    def _start(self, member: str, *args: str) -> None:
        """`ray start ARGS` in `member`; again (after killing what it left) when it fails:
        `ray start` gives a raylet 30 s (not configurable) to register with the GCS, which a
        loaded 2-core box now and then misses."""
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                return self._start_once(member, *args)
            except RuntimeError:
                if attempt == START_ATTEMPTS:
                    raise
                kill_all_in(self.topo, member)

    def _start_once(self, member: str, *args: str) -> None:
        temp_dir = tempfile.mkdtemp(prefix="drn", dir="/tmp")
        self.temp_dirs.append(temp_dir)
        ports = [str(x) for kv in RAY_PORTS.items() for x in kv]
        argv = [RAY, "start", "--node-ip-address", self.topo.address(member), "--temp-dir",
                temp_dir, "--disable-usage-stats", "--object-store-memory",
                str(OBJECT_STORE_BYTES), "--min-worker-port", str(WORKER_PORTS.start),
                "--max-worker-port", str(WORKER_PORTS.stop - 1), *ports, *args]
        res = subprocess.run(self.topo.exec_argv(member, argv), capture_output=True, text=True,
                             timeout=240, env={**os.environ, **RAY_ENV})
        if res.returncode != 0:
            raise RuntimeError(f"ray start in {member} failed ({res.returncode}):\n"
                               f"{res.stdout[-2000:]}\n{res.stderr[-2000:]}")

    def start(self) -> "NetnsRay":
        try:
            self._start(self.head, "--head", "--port", str(GCS_PORT), "--num-cpus", "0",
                        "--include-dashboard", "false", "--ray-client-server-port",
                        str(CLIENT_SERVER_PORT))
            for member, (cpus, resources) in self.nodes.items():
                self._start(member, "--address", self.address, "--num-cpus", str(cpus),
                            "--resources", json.dumps(resources))
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Kill every process in the cluster's namespaces (a raylet may still be forking
        workers: repeat until none is left), then remove the temp dirs."""
        for member in self.members:
            kill_all_in(self.topo, member)
        for temp_dir in self.temp_dirs:
            shutil.rmtree(temp_dir, ignore_errors=True)
        self.temp_dirs.clear()

    def __enter__(self) -> "NetnsRay":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def kill_all_in(topo: NetnsTopology, member: str) -> None:
    """SIGKILL every process in `member`'s namespace until none is left (a raylet may still
    be forking workers)."""
    deadline = time.monotonic() + 30
    while (pids := pids_in(topo, member)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)


def pids_in(topo: NetnsTopology, member: str) -> list[int]:
    res = subprocess.run(("ip", "netns", "pids", topo.ns(member)), capture_output=True,
                         text=True, timeout=30)
    return [int(p) for p in res.stdout.split()]


def sockets(topo: NetnsTopology, member: str, listening: bool) -> list[tuple[str, int, str, set]]:
    """(local address, local port, peer "addr:port", owning pids) of `member`'s TCP sockets:
    listening ones, or established ones."""
    flags = "-ltnpH" if listening else "-tnpH"
    out = subprocess.run(topo.exec_argv(member, ["ss", flags]), capture_output=True, text=True,
                         check=True, timeout=30).stdout
    rows = []
    for line in out.splitlines():
        fields = line.split()
        if not listening and fields[0] != "ESTAB":
            continue
        host, _, port = fields[3].rpartition(":")
        host = host.strip("[]").removeprefix("::ffff:")
        peer = fields[4].replace("[::ffff:", "").replace("]", "")
        rows.append((host, int(port), peer, {int(p) for p in re.findall(r"pid=(\d+)", line)}))
    return rows


def ray_listeners(topo: NetnsTopology, member: str, ours: set[int],
                  http_port: int) -> tuple[list[int], dict[int, str]]:
    """Split the ports listening on `member`'s address (or any) into DeepInfer's (held by a
    pid in `ours`, not one of Ray's pinned ports in that pid, not HTTP) and Ray's
    ({port: owner's command}, everything else)."""
    addr = topo.address(member)
    deepinfer, ray_ports = set(), {}
    for host, port, _, pids in sockets(topo, member, listening=True):
        if host not in (addr, "0.0.0.0", "*", "::") or port == http_port:
            continue
        if pids & ours and not is_ray_port(port):
            deepinfer.add(port)
        else:
            ray_ports[port] = " ".join(_cmdline(pid) for pid in sorted(pids))
    return sorted(deepinfer), ray_ports


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
    except OSError:
        return "?"


def tx_bytes(topo: NetnsTopology, member: str) -> int:
    """Bytes sent on `member`'s eth0 (its veth: traffic to another namespace)."""
    out = subprocess.run(topo.exec_argv(member, ["cat", "/sys/class/net/eth0/statistics/tx_bytes"]),
                         capture_output=True, text=True, check=True, timeout=30).stdout
    return int(out)
