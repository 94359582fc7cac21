"""Rank 0's torch.distributed rendezvous store listens on the group's address only (TCPStore
left to itself binds every interface of the host, unauthenticated)."""
from __future__ import annotations

import datetime

from deepinfer.ep.process_group import _rendezvous_store, free_port


def _listening(port: int) -> set[str]:
    """Local addresses (hex, as the kernel lists them) listening on `port`, IPv4 and IPv6."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                addr, hex_port = fields[1].rsplit(":", 1)
                if fields[3] == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    found.add(addr)
    return found


def test_rank_zero_store_listens_on_loopback_only_and_serves():
    port = free_port()
    store = _rendezvous_store(0, 1, "127.0.0.1", port, datetime.timedelta(seconds=10))
    assert _listening(port) == {"0100007F"}  # 127.0.0.1, not 0.0.0.0 or [::]
    store.set("k", "v")
    assert store.get("k") == b"v"
    del store
