"""Where cluster workers run. A `WorkerLauncher` turns a `WorkerSpec` into a process-like
handle (`start`, `is_alive`, `exitcode`, `pid`, `kill`, `join`), so `DisaggClient` spawns,
watches and restarts workers the same way on this machine and on a cluster:

    LocalLauncher              multiprocessing spawn of `worker_proc.run_worker_proc`
    ray_launcher.RayLauncher   one Ray actor per worker, running the same function

The worker classes and the ZMQ data plane are the same under both; a launcher only decides
placement, the host the front binds (one the workers can reach) and which deployments it
refuses (`check`)."""
from __future__ import annotations

import multiprocessing
from typing import Protocol

from deepinfer.cluster.worker_spec import WorkerSpec

CLUSTER_KINDS_HELP = ("local (worker processes on this machine), ray (the Ray cluster named by "
                      "RAY_ADDRESS, or a new local one), or ray://HOST:PORT (Ray Client)")


class WorkerProcess(Protocol):
    """The part of `multiprocessing.Process` the front uses."""

    @property
    def pid(self) -> int | None: ...

    @property
    def exitcode(self) -> int | None: ...

    def start(self) -> None: ...

    def is_alive(self) -> bool: ...

    def kill(self) -> None: ...

    def join(self, timeout: float | None = None) -> None: ...


class WorkerLauncher(Protocol):
    name: str

    def check(self, cluster) -> None:
        """Raise ValueError (one line) for a deployment this launcher cannot run."""

    def process(self, spec: WorkerSpec) -> WorkerProcess:
        """An unstarted handle that runs `spec`'s worker when started."""

    def placement(self, proc: WorkerProcess) -> dict:
        """Where a started worker runs (for /admin/workers and tests)."""

    def close(self) -> None: ...


class LocalLauncher:
    """Worker processes on this machine (spawned, so no torch state is inherited)."""

    name = "local"

    def __init__(self, host: str | None = None) -> None:
        self._host = host  # None: loopback (nothing off this machine can reach the sockets)

    def front_host(self) -> str:
        """The address the front's and the workers' sockets bind and advertise."""
        return self._host or "127.0.0.1"

    def check(self, cluster) -> None:
        pass

    def process(self, spec: WorkerSpec) -> WorkerProcess:
        from deepinfer.cluster.worker_proc import run_worker_proc
        ctx = multiprocessing.get_context("spawn")
        return ctx.Process(target=run_worker_proc, args=(spec,), name=f"deepinfer-{spec.worker_id}",
                           daemon=True)

    def placement(self, proc: WorkerProcess) -> dict:
        return {"launcher": self.name, "pid": proc.pid}

    def close(self) -> None:
        pass


def launcher_for(kind: str, **ray_options) -> WorkerLauncher:
    """`--cluster` value -> launcher. Ray is imported only when asked for."""
    if kind == "local":
        return LocalLauncher()
    if kind == "ray" or kind.startswith("ray://"):
        from deepinfer.cluster.ray_launcher import RayLauncher
        return RayLauncher(address=None if kind == "ray" else kind, **ray_options)
    raise ValueError(f"unknown --cluster {kind!r}: choose {CLUSTER_KINDS_HELP}")


def add_placement_args(parser) -> None:
    from deepinfer.arg_groups import group
    from deepinfer.cluster.ray_launcher import (  # imports no ray
        EP_RESOURCES_HELP, EP_STRATEGY_HELP, RESOURCES_HELP)
    g = group(parser, "cluster")
    g.add_argument("--cluster", default="local", metavar="KIND",
                   help=f"where prefill/decode workers run: {CLUSTER_KINDS_HELP}")
    g.add_argument("--prefill-resources", default=None, metavar="JSON",
                   help=f"--cluster ray: {RESOURCES_HELP} (default: 1 CPU, and 1 GPU when the "
                        f"cluster has GPUs)")
    g.add_argument("--decode-resources", default=None, metavar="JSON",
                   help="--cluster ray: the same for each decode worker")
    group(parser, "prefix-store").add_argument(
        "--kv-store-shared", action="store_true",
        help="the fs --kv-store path is a filesystem every node mounts at that path (without "
             "it an fs store is refused when prefill workers can span nodes)")
    g.add_argument("--drain-timeout", type=float, default=120.0, metavar="S",
                   help="seconds a worker removed by `deepinfer scale` may take to finish its "
                        "requests; what is left then is retried or failed like a lost worker's")
    g.add_argument("--ep-rank-resources", default=None, metavar="JSON", help=EP_RESOURCES_HELP)
    g.add_argument("--ep-placement-strategy", default=None, metavar="STRATEGY",
                   help=EP_STRATEGY_HELP)
    g.add_argument("--cluster-host", default=None, metavar="IP",
                   help="the address the cluster's sockets bind and workers use to reach "
                        "them (--cluster ray: default this node's IP as Ray sees it; "
                        "--cluster local: default 127.0.0.1)")


def launcher_from_args(args) -> WorkerLauncher:
    """The launcher `--cluster` names; Ray flags without Ray are an error."""
    kind = getattr(args, "cluster", "local")
    if kind == "local":
        for flag in ("prefill_resources", "decode_resources"):
            if getattr(args, flag, None) is not None:
                raise ValueError(f"--{flag.replace('_', '-')} needs --cluster ray")
        return LocalLauncher(host=getattr(args, "cluster_host", None))
    if kind != "ray" and not kind.startswith("ray://"):
        raise ValueError(f"unknown --cluster {kind!r}: choose {CLUSTER_KINDS_HELP}")
    from deepinfer.cluster.ray_launcher import RoleResources
    resources = {"prefill": RoleResources.parse(args.prefill_resources, "--prefill-resources"),
                 "decode": RoleResources.parse(args.decode_resources, "--decode-resources")}
    try:
        import ray  # noqa: F401
    except ImportError:
        raise ValueError("--cluster ray needs Ray: pip install 'deepinfer[ray]'") from None
    return launcher_for(kind, role_resources=resources,
                        kv_store_shared=args.kv_store_shared, front_host=args.cluster_host)


def placement_config(args, launcher: WorkerLauncher) -> dict:
    """ClusterConfig fields that depend on the launcher (the host the front binds)."""
    out = {"kv_store_shared": getattr(args, "kv_store_shared", False),
           "drain_timeout_s": getattr(args, "drain_timeout", 120.0)}
    if hasattr(launcher, "front_host"):
        out["host"] = launcher.front_host()
    return out
