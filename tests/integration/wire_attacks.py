"""Hostile peers for the wire tests: find a server's ZMQ endpoints and throw bad frames at
them (garbage, truncated, unknown version, another key, forged MAC, replayed, wrong message
type, a pickle that would write a file, the wrong number of parts)."""
from __future__ import annotations

import os
import pickle
import time

import msgspec
import psutil
import zmq

from deepinfer.wire.frame import HEADER_BYTES, FrameSigner


class _WriteFile:
    """Unpickling this would create `path` (it never may be unpickled)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def pickle_bomb(path: str) -> bytes:
    return pickle.dumps(_WriteFile(path))


def process_tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root] + root.children(recursive=True)


def ipc_endpoints(pid: int, name_part: str) -> list[str]:
    """ipc:// paths bound by `pid`'s tree whose file name contains `name_part`."""
    paths = set()
    for proc in process_tree(pid):
        for conn in proc.net_connections(kind="unix"):
            if conn.laddr and name_part in os.path.basename(conn.laddr):
                paths.add(conn.laddr)
    return sorted(f"ipc://{p}" for p in paths)


def tcp_listeners(pid: int, exclude_ports=()) -> list[str]:
    """tcp://127.0.0.1:port of every listening socket in `pid`'s tree."""
    ports = set()
    for proc in process_tree(pid):
        for conn in proc.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr.port not in exclude_ports:
                ports.add(conn.laddr.port)
    return [f"tcp://127.0.0.1:{p}" for p in sorted(ports)]


def hostile_frames(channel: str, marker_path: str, secret_key: bytes) -> list[tuple[str, bytes]]:
    """(expected drop reason, frame) for one channel. `secret_key` is the deployment's key:
    some frames are correctly signed but replayed or of the wrong type."""
    signer = FrameSigner(channel, secret_key)
    good = signer.sign(msgspec.msgpack.encode({"type": "Bogus", "x": 1}))  # authentic, wrong type
    forged = bytearray(signer.sign(b"\x90"))
    forged[30] ^= 0xFF  # inside the MAC
    other_key = FrameSigner(channel, os.urandom(32)).sign(b"\x90")
    return [
        ("truncated", b"garbage"),
        ("truncated", b""),
        ("version", b"\x07" + os.urandom(80)),
        # pickle's protocol byte 0x80 is no frame version (and nothing unpickles it)
        ("version" if len(pickle_bomb(marker_path)) >= HEADER_BYTES else "truncated",
         pickle_bomb(marker_path)),
        ("key", other_key),
        ("mac", bytes(forged)),
        ("type", good),
        ("replay", good),  # the same authentic frame again
        ("decode", signer.sign(b"\xc1\xc1\xc1")),
    ]


class Attacker:
    """Raw PUSH and DEALER sockets connected to endpoints (a stray local process)."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sockets: list[zmq.Socket] = []

    def socket(self, kind: int, endpoint: str) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDTIMEO, 2000)
        sock.connect(endpoint)
        self.sockets.append(sock)
        return sock

    def send(self, kind: int, endpoint: str, messages: list[list[bytes]]) -> None:
        """Send each multipart message; a peer of an incompatible type never takes any (the
        send times out and the rest are skipped)."""
        sock = self.socket(kind, endpoint)
        try:
            for parts in messages:
                sock.send_multipart(parts)
        except zmq.Again:
            pass

    def close(self) -> None:
        time.sleep(0.5)  # let queued frames go out
        for sock in self.sockets:
            sock.close(linger=0)
        self.ctx.term()
