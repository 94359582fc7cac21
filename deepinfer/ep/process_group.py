"""torch.distributed for one rank of an EP group: NCCL on CUDA, gloo on CPU. The rendezvous
address is 127.0.0.1 for the local launcher, rank 0's node IP for a group placed on Ray.

Collectives carry a timeout, so a rank whose peer hangs fails (and exits) instead of waiting
forever. Step headers always go over a gloo group on the CPU, also when the experts talk NCCL.
"""
from __future__ import annotations

import datetime
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
    dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=rank,
                            world_size=world_size, timeout=timeout, **kwargs)
    control = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
    return RankGroup(rank, world_size, device, control)


def destroy_rank_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
