"""Real network namespaces for hostile-network tests: members joined by veth pairs to a bridge.

Shape (every name carries a per-session tag, so parallel sessions never collide):

    member ns "front"  eth0 10.S.0.1/24 ──veth── vfront ─┐
    member ns "worker" eth0 10.S.0.2/24 ──veth── vworker ┼─ br0 in the hub ns (a switch only)
    member ns "attack" eth0 10.S.0.3/24 ──veth── vattack ┘

Nothing is attached to the root namespace unless `root_port=True`: then the test process itself
gets a veth on the bridge as 10.S.0.254 (a connected /24 route in the host, gone at close) so
it can talk HTTP to a server inside a member without entering a namespace. Traffic
between members crosses real interfaces and the bridge; `cut(member)` downs its bridge port
(its packets are dropped, connections stall like an unplugged cable) and `heal(member)` brings
it back. `close()` always deletes every namespace it made (veths die with them), after killing
the processes still running inside them (they were started by the test).

Root is required: `require_netns()` skips without it, and raises (fails the test loudly) when
root cannot create namespaces, since CI runs as root and must exercise this.
"""
from __future__ import annotations

import os
import secrets
import signal
import subprocess
import time
from dataclasses import dataclass, field


def _ip(*args: str) -> str:
    """Run `ip ARGS`; raise with its stderr on failure (a broken topology must fail loudly)."""
    res = subprocess.run(("ip", *args), capture_output=True, text=True, timeout=30)
    if res.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({res.returncode}): {res.stderr.strip()}")
    return res.stdout


def require_netns() -> None:
    """Skip (pytest) when not root; raise when root but `ip netns` does not work."""
    import pytest
    if os.geteuid() != 0:
        pytest.skip("network-namespace tests need root (CI runs them as root)")
    probe = f"dip{secrets.token_hex(4)}"
    try:
        _ip("netns", "add", probe)
    except (OSError, RuntimeError) as exc:
        raise RuntimeError(f"running as root but `ip netns add` fails: {exc}") from exc
    _ip("netns", "del", probe)


@dataclass
class NetnsTopology:
    """Member namespaces on one /24 behind a bridge; see the module docstring for the shape."""

    members: tuple[str, ...]
    root_port: bool = False
    tag: str = field(default_factory=lambda: secrets.token_hex(3))
    subnet_octet: int = field(default_factory=lambda: 100 + secrets.randbelow(150))
    _created: list[str] = field(default_factory=list)

    @property
    def hub(self) -> str:
        return f"di{self.tag}-hub"

    def ns(self, member: str) -> str:
        """The namespace name of `member` (for `ip netns exec`)."""
        return f"di{self.tag}-{member}"

    def address(self, member: str) -> str:
        return f"10.{self.subnet_octet}.0.{self.members.index(member) + 1}"

    def _port(self, member: str) -> str:
        return f"v{self.members.index(member)}{self.tag}"  # <= 15 chars (IFNAMSIZ)

    def open(self) -> "NetnsTopology":
        if len(set(self.members)) != len(self.members) or not self.members:
            raise ValueError(f"member names must be distinct and non-empty: {self.members}")
        try:
            self._add_ns(self.hub)
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "link", "set", "br0", "up")
            for member in self.members:
                self._add_member(member)
            if self.root_port:
                self._add_root_port()
        except BaseException:
            self.close()
            raise
        return self

    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._created.append(name)
        _ip("-n", name, "link", "set", "lo", "up")  # workers also talk over 127.0.0.1 inside

    def _add_member(self, member: str) -> None:
        ns, port = self.ns(member), self._port(member)
        self._add_ns(ns)
        _ip("-n", self.hub, "link", "add", port, "type", "veth", "peer", "name", "eth0",
            "netns", ns)
        _ip("-n", self.hub, "link", "set", port, "master", "br0")
        _ip("-n", self.hub, "link", "set", port, "up")
        _ip("-n", ns, "addr", "add", f"{self.address(member)}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")

    def _add_root_port(self) -> None:
        # Created in the hub with its peer moved to the root ns: deleting the hub deletes both.
        peer = f"dr{self.tag}"
        _ip("-n", self.hub, "link", "add", "vroot", "type", "veth", "peer", "name", peer,
            "netns", "1")
        _ip("-n", self.hub, "link", "set", "vroot", "master", "br0")
        _ip("-n", self.hub, "link", "set", "vroot", "up")
        _ip("addr", "add", f"{self.root_address}/24", "dev", peer)
        _ip("link", "set", peer, "up")

    @property
    def root_address(self) -> str:
        return f"10.{self.subnet_octet}.0.254"

    def cut(self, member: str) -> None:
        """Drop all of `member`'s traffic to the others (its bridge port goes down)."""
        _ip("-n", self.hub, "link", "set", self._port(member), "down")

    def heal(self, member: str) -> None:
        _ip("-n", self.hub, "link", "set", self._port(member), "up")

    def exec_argv(self, member: str, argv: list[str] | tuple[str, ...]) -> list[str]:
        """`argv` prefixed to run inside `member`'s namespace (for subprocess.Popen)."""
        return ["ip", "netns", "exec", self.ns(member), *argv]

    def close(self) -> None:
        """Kill what still runs inside, then delete every namespace made (idempotent)."""
        if self.root_port:  # explicitly: a namespace's veths are destroyed asynchronously
            subprocess.run(("ip", "link", "del", f"dr{self.tag}"), capture_output=True,
                           timeout=30)
        for name in reversed(self._created):
            _kill_pids_in(name)
            subprocess.run(("ip", "netns", "del", name), capture_output=True, timeout=30)
        self._created.clear()

    def __enter__(self) -> "NetnsTopology":
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _kill_pids_in(name: str) -> None:
    res = subprocess.run(("ip", "netns", "pids", name), capture_output=True, text=True,
                         timeout=30)
    pids = [int(p) for p in res.stdout.split()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if sig == signal.SIGTERM and pids:
            time.sleep(0.5)


def netns_names() -> set[str]:
    """The namespaces that exist now (to check teardown)."""
    out = _ip("netns", "list")
    return {line.split()[0] for line in out.splitlines() if line.strip()}
