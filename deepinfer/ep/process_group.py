"""torch.distributed for one rank of an EP group: NCCL on CUDA, gloo on CPU. The rendezvous
address is 127.0.0.1 for the local launcher, rank 0's node IP for a group placed on Ray.

Rank 0 serves the rendezvous store (PyTorch's TCPStore) on a socket it binds itself to that
one address and hands to the store: left to itself, TCPStore listens on every interface of the
host, unauthenticated, so any machine that can reach the host could join or poison the group.

Collectives carry a timeout, so a rank whose peer hangs fails (and exits) instead of waiting
forever. Step headers always go over a gloo group on the CPU, also when the experts talk NCCL.
"""
from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class RankGroup:
    rank: int
    world_size: int
    device: torch.device
    control_group: object  # gloo group for the step header (None: the default group)

    def all_reduce_cpu(self, values: list[int]) -> list[int]:
        """Sum small integers over the group (the step header)."""
        t = torch.tensor(values, dtype=torch.long)
        dist.all_reduce(t, group=self.control_group)
        return t.tolist()


def init_rank_group(rank: int, world_size: int, port: int, device: torch.device,
                    backend: str | None, timeout_s: float,
                    host: str = "127.0.0.1") -> RankGroup:
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    timeout = datetime.timedelta(seconds=timeout_s)
    kwargs = {"device_id": device} if backend == "nccl" else {}
    store = _rendezvous_store(rank, world_size, host, port, timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timeout, **kwargs)
    control = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
    return RankGroup(rank, world_size, device, control)


def _rendezvous_store(rank: int, world_size: int, host: str, port: int,
                      timeout: datetime.timedelta) -> dist.TCPStore:
    """The group's TCPStore: rank 0 serves it on a socket bound to `host` only."""
    if rank != 0:
        return dist.TCPStore(host, port, world_size, False, timeout)
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(128)
    fd = listener.detach()  # the store's server owns the socket from here on
    try:
        return dist.TCPStore(host, port, world_size, True, timeout,
                             wait_for_workers=False, master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise


def destroy_rank_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
