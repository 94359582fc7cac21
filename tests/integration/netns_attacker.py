"""A hostile host for the netns tests: run inside the attacker's namespace, it connects stray
PUSH and DEALER peers to each tcp:// endpoint given and sends every frame of
`wire_attacks.hostile_frames` (with the deployment's key for the replayed / wrongly typed
ones), oversized and multi-part frames, and a pickle that would write MARKER. Meanwhile a
passive PULL and a passive DEALER on each endpoint wait for any frame the cluster hands a
stray peer; their count is printed ("stray frames received: N").

    ip netns exec NS python -m tests.integration.netns_attacker KEY_HEX MARKER ROUNDS EP...
"""
from __future__ import annotations

import sys

import zmq

from tests.integration.wire_attacks import Attacker, hostile_frames, pickle_bomb

OVERSIZED = b"\x01" + b"\xff" * (8 << 20)  # 8 MiB: larger than any legitimate control frame


def attack(endpoints: list[str], key: bytes, marker: str, rounds: int) -> int:
    """-> the frames the passive strays received."""
    attacker = Attacker()
    passive = [attacker.socket(kind, endpoint) for endpoint in endpoints
               for kind in (zmq.PULL, zmq.DEALER)]
    try:
        for _ in range(rounds):
            for endpoint in endpoints:
                for kind in ("worker.hello", "worker.output", "kv.pull", "engine.input"):
                    frames = [f for _, f in hostile_frames(f"{kind}@{endpoint}", marker, key)]
                    frames += [OVERSIZED, pickle_bomb(marker)]
                    attacker.send(zmq.PUSH, endpoint, [[f] for f in frames])
                    attacker.send(zmq.DEALER, endpoint, [[f] for f in frames])
                attacker.send(zmq.DEALER, endpoint, [[b"a", b"b"], [b"x"] * 5])
        received = 0
        for sock in passive:
            while sock.poll(0):
                sock.recv()
                received += 1
        return received
    finally:
        attacker.close()


def main(argv: list[str]) -> None:
    key_hex, marker, rounds, *endpoints = argv
    received = attack(endpoints, bytes.fromhex(key_hex), marker, int(rounds))
    print(f"attacked {len(endpoints)} endpoints", flush=True)
    print(f"stray frames received: {received}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
