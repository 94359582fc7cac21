"""Cut one process off the network inside a namespace: every TCP packet to or from a local
port that process holds is dropped by iptables in that namespace (traffic between two local
addresses runs over lo, so this also cuts it from its neighbours in the same namespace).

tc cannot do it on this project's kernels (the u32 classifier loads, but no drop action:
act_gact is absent), hence iptables; `require_iptables()` installs it with apt-get when root
and fails loudly when it cannot. The process's ports are re-read while the cut lasts, so a
connection it re-dials from a new port is cut too.
"""
from __future__ import annotations

import re
import shutil
import subprocess

from tests.integration.netns import NetnsTopology

CHAIN = "DI_CUT"


def require_iptables() -> None:
    if shutil.which("iptables") is None:
        res = subprocess.run("apt-get update -qq && apt-get install -y -qq iptables",
                             shell=True, capture_output=True, text=True, timeout=600)
        if res.returncode != 0 or shutil.which("iptables") is None:
            raise RuntimeError(f"iptables is missing and could not be installed "
                               f"(make system-deps):\n{res.stderr[-2000:]}")


def tcp_sockets(topo: NetnsTopology, member: str) -> list[tuple[str, int, set[int]]]:
    """(state, local port, owning pids) of every TCP socket in `member`'s namespace, from
    `ss -tanp` run there (psutil reads the caller's /proc/net/tcp, not the namespace's)."""
    out = subprocess.run(topo.exec_argv(member, ["ss", "-tanpH"]), capture_output=True,
                         text=True, check=True, timeout=30).stdout
    sockets = []
    for line in out.splitlines():
        fields = line.split()
        port = int(fields[3].rpartition(":")[2])
        sockets.append((fields[0], port, {int(p) for p in re.findall(r"pid=(\d+)", line)}))
    return sockets


def local_ports(topo: NetnsTopology, member: str, pid: int) -> set[int]:
    """Local TCP ports of `pid`'s sockets (listening or connected) in `member`'s namespace."""
    return {port for _, port, pids in tcp_sockets(topo, member) if pid in pids}


class PortCut:
    """`cut(pid)` drops all of a process's TCP traffic in `member`'s namespace; `refresh()`
    adds ports it opened since; `heal()` deletes every rule."""

    def __init__(self, topo: NetnsTopology, member: str) -> None:
        self.topo, self.member = topo, member
        self.pid: int | None = None
        self.ports: set[int] = set()

    def _iptables(self, *args: str) -> None:
        res = subprocess.run(self.topo.exec_argv(self.member, ["iptables", "-w", *args]),
                             capture_output=True, text=True, timeout=30)
        if res.returncode != 0:
            raise RuntimeError(f"iptables {' '.join(args)} failed: {res.stderr.strip()}")

    def cut(self, pid: int) -> set[int]:
        self.pid = pid
        self._iptables("-N", CHAIN)
        self._iptables("-I", "OUTPUT", "-j", CHAIN)
        return self.refresh()

    def refresh(self) -> set[int]:
        for port in sorted(local_ports(self.topo, self.member, self.pid) - self.ports):
            for direction in ("--sport", "--dport"):
                self._iptables("-A", CHAIN, "-p", "tcp", direction, str(port), "-j", "DROP")
            self.ports.add(port)
        return set(self.ports)

    def heal(self) -> None:
        if self.pid is None:
            return
        self._iptables("-D", "OUTPUT", "-j", CHAIN)
        self._iptables("-F", CHAIN)
        self._iptables("-X", CHAIN)
        self.pid, self.ports = None, set()
