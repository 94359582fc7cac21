"""Data-parallel / expert-parallel rank groups on Ray (`deepinfer serve --cluster ray
--data-parallel-size N --enable-expert-parallel`).

Each group of N ranks reserves one Ray placement group of N bundles (`STRICT_PACK` by
default: one node, its NVLink; `PACK` / `SPREAD` let a wide group span nodes); rank r is an
actor scheduled into bundle r and runs the unchanged `ep.rank_proc.run_rank_proc` in a thread.
What changes against the local launcher is only addressing and lifecycle:

- the front's sockets are `tcp://` on an address every node reaches (not `ipc://`);
- the ranks' torch.distributed rendezvous is rank 0's node IP (as Ray reports it) and a port
  free there, not 127.0.0.1; gloo / NCCL are pointed at the interface holding that IP;
- a rank's death is seen through Ray (its pending `wait()` fails) as well as through the
  rank's own EngineDead; the group is then killed as a whole, its placement group removed,
  and the data-parallel client's supervisor starts a new one (actors have `max_restarts=0`).

Ray is imported only when a `RayRankPlacement` is made."""
from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass

from deepinfer.cluster.ray_actors import LoopThread, RayActorProcess
from deepinfer.cluster.ray_launcher import (DEFAULT_EP_STRATEGY, EP_PLACEMENT_STRATEGIES,
                                            RoleResources, connect_actors, disconnect_ray)
from deepinfer.ep.rank_group_handle import GroupHandle, RankHandle, front_sockets
from deepinfer.engine.exceptions import EngineDeadError

logger = logging.getLogger(__name__)

def interface_of(ip: str) -> str | None:
    """The network interface holding `ip` on this machine (None when none does)."""
    try:
        import psutil
    except ImportError:  # then gloo / NCCL pick their interface themselves
        return None
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == ip for a in addresses):
            return name
    return None


class RankActor(LoopThread):
    """One rank of a group: `where` says where it runs, `free_port` picks a port on its node
    (rank 0's is the group's rendezvous), `start` runs the rank loop in a thread."""

    def where(self) -> dict:
        import ray
        context = ray.get_runtime_context()
        return {"pid": os.getpid(), "node_id": context.get_node_id(),
                "node_ip": ray.util.get_node_ip_address(), "actor_id": context.get_actor_id(),
                "placement_group_id": context.get_placement_group_id()}

    def free_port(self) -> int:
        import ray

        from deepinfer.ep.process_group import free_port
        return free_port(ray.util.get_node_ip_address())

    def start(self, kwargs: dict) -> None:
        import ray

        from deepinfer.ep.rank_proc import run_rank_proc
        # Collectives must leave through the interface that holds the node IP Ray reports
        # (gloo otherwise resolves the hostname, which may name a loopback address).
        interface = interface_of(ray.util.get_node_ip_address())
        if interface is not None:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)
        # No parent pid: Ray ends the actor with its owner. Failures are reported to the
        # front as EngineDead where possible.
        self._start_loop(lambda: run_rank_proc(**kwargs), f"deepinfer-rank{kwargs['rank']}",
                         f"rank {kwargs.get('rank')}")


class RayRankProcess(RayActorProcess):
    """A rank's actor, as the process handle `RankHandle.proc` expects."""

    def __init__(self, actor_class, options: dict, name: str) -> None:
        super().__init__(name)
        self._actor_class, self.options = actor_class, options
        self.addresses: tuple[str, str] | None = None  # the front's (input, output) sockets

    def create(self) -> None:
        actor = self._actor_class.options(**self.options).remote()
        self._attach(actor, actor.where.remote())

    def start_rank(self, **kwargs) -> None:
        self.actor.start.remote(kwargs)  # failures show in wait() or as EngineDead


def bundles_that_fit(bundle: dict[str, float], node_resources: dict[str, float]) -> int:
    """How many copies of `bundle` a node's total resources hold."""
    return int(min(node_resources.get(k, 0.0) // v for k, v in bundle.items()))


def group_room(bundle: dict[str, float], nodes: list[dict], strategy: str) -> int:
    """The most ranks (bundles) a group placed with `strategy` can have on these nodes
    (`ray.nodes()` entries, total resources): one node's worth for STRICT_PACK, one per node
    for STRICT_SPREAD, all nodes' worth for PACK / SPREAD."""
    per_node = [bundles_that_fit(bundle, n.get("Resources", {})) for n in nodes if n.get("Alive")]
    if strategy == "STRICT_PACK":
        return max(per_node, default=0)
    if strategy == "STRICT_SPREAD":
        return sum(1 for n in per_node if n > 0)
    return sum(per_node)


class RayRankPlacement:
    """Connects to Ray (as `RayLauncher` does) and reserves one placement group per group
    incarnation."""

    name = "ray"

    def __init__(self, address: str | None = None, resources: RoleResources | None = None,
                 strategy: str = DEFAULT_EP_STRATEGY, front_host: str | None = None,
                 init_kwargs: dict | None = None) -> None:
        if strategy not in EP_PLACEMENT_STRATEGIES:
            raise ValueError(f"--ep-placement-strategy must be one of "
                             f"{', '.join(EP_PLACEMENT_STRATEGIES)}, got {strategy!r}")
        self.resources = resources or RoleResources()
        self.strategy = strategy
        self.address = address
        self._owns_ray, self._has_gpus, self._front_host, self._actor_class = connect_actors(
            address, front_host, init_kwargs, RankActor)

    def front_host(self) -> str:
        return self._front_host

    def bundle(self) -> dict[str, float]:
        """One rank's resources in Ray's names: one bundle of the placement group."""
        return self.resources.request(self._has_gpus)

    def check(self, size: int) -> None:
        """Refuse a group no set of alive nodes can hold (it would wait forever)."""
        import ray
        bundle = self.bundle()
        if not bundle:
            raise ValueError("--ep-rank-resources: a rank must ask for some resource "
                             "(Ray placement-group bundles cannot be empty)")
        room = group_room(bundle, ray.nodes(), self.strategy)
        if room < size:
            raise ValueError(f"a group of {size} ranks asking for {bundle} each cannot be placed "
                             f"{self.strategy} on this Ray cluster (room for {room}); cluster "
                             f"resources: {ray.cluster_resources()}")

    def reserve(self, size: int, timeout_s: float):
        """A ready placement group of `size` bundles; EngineDeadError if Ray cannot give it
        within `timeout_s` (e.g. the resources are held by others)."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        pg = placement_group([self.bundle()] * size, strategy=self.strategy)
        ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
        if not ready:
            remove_placement_group(pg)
            raise EngineDeadError(f"Ray did not place a group of {size} x {self.bundle()} "
                                  f"({self.strategy}) within {timeout_s:.0f} s")
        return pg

    def rank_process(self, pg, rank: int, name: str) -> RayRankProcess:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        options = self.resources.actor_options(self._has_gpus)
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=rank)
        return RayRankProcess(self._actor_class, options, name)

    @staticmethod
    def release(pg) -> None:
        from ray.util.placement_group import remove_placement_group
        try:
            remove_placement_group(pg)
        except Exception as exc:  # Ray already gone (shutdown)
            logger.warning("could not remove a placement group: %s", exc)

    def close(self) -> None:
        disconnect_ray(self._owns_ray)


@dataclass
class RayGroupHandle(GroupHandle):
    """A group whose ranks are actors in one placement group (see the module docstring)."""

    placement: RayRankPlacement | None = None
    pg: object = None  # this incarnation's placement group
    rendezvous: tuple[str, int] | None = None  # torch.distributed master (rank 0's node IP)

    async def _start_ranks(self, ctx, ipc_dir: str, engine_config, ep_config, log_level: str,
                           deadline: float) -> None:
        self.pg = await asyncio.to_thread(self.placement.reserve, self.size,
                                          deadline - time.monotonic())
        host = self.placement.front_host()
        for r in range(self.size):
            proc = self.placement.rank_process(
                self.pg, r, f"deepinfer-g{self.index}-rank{r}-{self.incarnation}")
            proc.create()
            input_socket, output_socket = front_sockets(ctx)
            input_port = input_socket.bind_to_random_port(f"tcp://{host}")
            output_port = output_socket.bind_to_random_port(f"tcp://{host}")
            proc.addresses = (f"tcp://{host}:{input_port}", f"tcp://{host}:{output_port}")
            self.ranks.append(RankHandle(self.index, r, self.index * self.size + r, proc,
                                         input_socket, output_socket
                                         ).with_channels(*proc.addresses))
        master_addr, port = "127.0.0.1", None
        if ep_config.enable_expert_parallel:
            master_addr, port = await asyncio.to_thread(
                self._rendezvous, self.ranks[0].proc, deadline - time.monotonic())
            self.rendezvous = (master_addr, port)
        for h in self.ranks:
            h.proc.start_rank(engine_config=engine_config, ep_config=ep_config, rank=h.rank,
                              port=port, input_addr=h.proc.addresses[0],
                              output_addr=h.proc.addresses[1], parent_pid=None,
                              log_level=log_level, master_addr=master_addr)
        await self._wait_all_up(deadline)

    @staticmethod
    def _rendezvous(rank0: RayRankProcess, timeout_s: float) -> tuple[str, int]:
        """Rank 0's node IP (as Ray reports it) and a port free there."""
        import ray
        try:
            where = ray.get(rank0._info_ref, timeout=max(1.0, timeout_s))
            port = ray.get(rank0.actor.free_port.remote(), timeout=max(1.0, timeout_s))
        except Exception as exc:
            raise EngineDeadError(f"rank 0 did not start on Ray: "
                                  f"{str(exc).strip().splitlines()[:1]}") from None
        return where["node_ip"], port

    async def kill(self) -> None:
        await super().kill()
        if self.pg is not None:
            self.placement.release(self.pg)  # its resources go back to Ray for the restart
            self.pg = None

    def placements(self) -> list[dict]:
        """Where each rank runs (as its actor read it from Ray)."""
        return [{"rank": h.rank, **(h.proc.info or {})} for h in self.ranks]


def rank_placement_from_args(args, ep_config) -> RayRankPlacement | None:
    """Where the rank groups of `serve --data-parallel-size N [--enable-expert-parallel]` run:
    None for this machine (`--cluster local`), else placement groups on Ray (checked now)."""
    kind = getattr(args, "cluster", "local")
    resources = getattr(args, "ep_rank_resources", None)
    strategy = getattr(args, "ep_placement_strategy", None)
    if kind == "local":
        for flag, value in (("--ep-rank-resources", resources),
                            ("--ep-placement-strategy", strategy)):
            if value is not None:
                raise ValueError(f"{flag} needs --cluster ray")
        return None
    if kind != "ray" and not kind.startswith("ray://"):
        from deepinfer.cluster.launcher import CLUSTER_KINDS_HELP
        raise ValueError(f"unknown --cluster {kind!r}: choose {CLUSTER_KINDS_HELP}")
    parsed = RoleResources.parse(resources, "--ep-rank-resources")
    strategy = (strategy or DEFAULT_EP_STRATEGY).upper()
    if strategy not in EP_PLACEMENT_STRATEGIES:
        raise ValueError(f"--ep-placement-strategy must be one of "
                         f"{', '.join(EP_PLACEMENT_STRATEGIES)}, got {strategy!r}")
    try:
        import ray  # noqa: F401
    except ImportError:
        raise ValueError("--cluster ray needs Ray: pip install 'deepinfer[ray]'") from None
    placement = RayRankPlacement(address=None if kind == "ray" else kind, resources=parsed,
                                 strategy=strategy, front_host=getattr(args, "cluster_host", None))
    size = ep_config.data_parallel_size if ep_config.enable_expert_parallel else 1
    try:
        placement.check(size)
    except ValueError:
        placement.close()
        raise
    return placement
