"""`RayLauncher`: prefill/decode workers as Ray actors (`deepinfer serve --cluster ray`).

Only placement, discovery and lifecycle move to Ray; each actor runs the same
`worker_proc.run_worker_proc` loop (in a thread of the actor process) and talks ZMQ to the
front exactly like a local worker process:

- placement: each role's actor options (`num_cpus`, `num_gpus`, `memory`, custom resources
  such as `prefill_node`) come from `--prefill-resources` / `--decode-resources`; a role no
  alive node can host is refused at start instead of waiting forever.
- discovery: the actor replaces the spec's host with its node's IP (from Ray), so the KV
  endpoint it announces in `WorkerReady` is reachable from other nodes; the front binds its
  sockets on its own node's IP (`front_host`).
- lifecycle: actors have `max_restarts=0`; `DisaggClient`'s supervisor restarts a lost worker
  (one restart policy, one back-off, one metric for both launchers, never two restarters).
  An actor's death is seen through Ray (its pending `wait()` call fails) as well as through
  missed heartbeats. A clean exit (ShutdownWorker, a failure) kills the actor, releasing its
  resources.

The actors and their front-side handles live in `ray_actors.py`. Ray is imported only by
these two modules; `import ray` happens when a `RayLauncher` is made."""
from __future__ import annotations

import json
import logging
import os
import socket
from dataclasses import dataclass, field

from deepinfer.cluster.ray_actors import RayWorkerProcess, WorkerActor
from deepinfer.cluster.worker_spec import CLUSTER_ROLES, WorkerSpec

logger = logging.getLogger(__name__)

RAY_CLIENT_ATTEMPTS = 3  # connections through ray:// (see connect_ray)
ACTOR_MAX_CONCURRENCY = 4  # start / wait / ping next to each other (threaded actor)
RESOURCES_HELP = ("JSON object of Ray resources per worker of this role: num_cpus, num_gpus, "
                  "memory (bytes) and custom resources, e.g. "
                  "'{\"num_gpus\": 1, \"prefill_node\": 1}'")
_STANDARD = {"num_cpus": "CPU", "num_gpus": "GPU", "memory": "memory"}
# EP groups on Ray (ray_ep_group.py): one placement group per group, one bundle per rank.
EP_PLACEMENT_STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")
DEFAULT_EP_STRATEGY = "STRICT_PACK"
EP_RESOURCES_HELP = ("--cluster ray: JSON object of Ray resources per rank of a data/expert-"
                     "parallel group (one placement-group bundle each), e.g. "
                     "'{\"num_gpus\": 1, \"decode_node\": 1}' (default: 1 CPU, and 1 GPU when "
                     "the cluster has GPUs)")
EP_STRATEGY_HELP = ("--cluster ray: how a group's ranks spread over nodes: STRICT_PACK (one "
                    "node, e.g. its NVLink; default), PACK (as few nodes as fit), SPREAD, "
                    "STRICT_SPREAD (multi-node groups talk over the network)")


@dataclass(frozen=True)
class RoleResources:
    """What one worker of a role asks Ray for. `num_gpus=None`: one GPU when the cluster has
    any, else none."""

    num_cpus: float = 1.0
    num_gpus: float | None = None
    memory: int | None = None
    custom: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        values = [self.num_cpus, self.num_gpus, self.memory, *self.custom.values()]
        if any(v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                                  or v < 0) for v in values):
            raise ValueError(f"Ray resources must be non-negative numbers, got {self}")

    @classmethod
    def parse(cls, text: str | None, flag: str) -> RoleResources:
        """From a `--<role>-resources` JSON object (None: the defaults)."""
        if text is None:
            return cls()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{flag}: not JSON ({exc.msg}): {text!r}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{flag}: expected a JSON object, got {text!r}")
        known = {k: data.pop(k) for k in list(data) if k in _STANDARD}
        for name in data:
            if name in _STANDARD.values():
                raise ValueError(f"{flag}: write {name!r} as "
                                 f"{[k for k, v in _STANDARD.items() if v == name][0]!r}")
        try:
            return cls(custom={str(k): v for k, v in data.items()}, **known)
        except ValueError as exc:
            raise ValueError(f"{flag}: {exc}") from None

    def request(self, cluster_has_gpus: bool) -> dict[str, float]:
        """The resource request in Ray's node-resource names (CPU, GPU, memory, custom)."""
        gpus = (1.0 if cluster_has_gpus else 0.0) if self.num_gpus is None else self.num_gpus
        out = {"CPU": float(self.num_cpus), "GPU": float(gpus), **self.custom}
        if self.memory:
            out["memory"] = float(self.memory)
        return {k: v for k, v in out.items() if v}

    def actor_options(self, cluster_has_gpus: bool) -> dict:
        request = self.request(cluster_has_gpus)
        options = {"num_cpus": request.get("CPU", 0.0), "num_gpus": request.get("GPU", 0.0)}
        if "memory" in request:
            options["memory"] = request["memory"]
        custom = {k: v for k, v in request.items() if k not in _STANDARD.values()}
        if custom:
            options["resources"] = custom
        return options


def nodes_that_fit(request: dict[str, float], nodes: list[dict]) -> list[dict]:
    """Alive nodes (`ray.nodes()` entries) whose total resources can hold `request`."""
    return [n for n in nodes if n.get("Alive") and all(
        n.get("Resources", {}).get(name, 0.0) >= amount for name, amount in request.items())]


def is_node_local_store(url: str | None) -> bool:
    """An fs store (a directory on the machine that opens it), as opposed to Redis or none."""
    if url in (None, "none"):
        return False
    base = url.strip().partition("?")[0]
    return base == "fs" or base.startswith(("fs://", "/", "~"))


def check_store_locality(store_url: str | None, shared: bool, prefill_nodes: list[dict]) -> None:
    """Prefill workers on different machines cannot share a node-local directory: each would
    see only its own blocks (and a restarted worker on another node none of them)."""
    if not is_node_local_store(store_url) or shared or len(prefill_nodes) <= 1:
        return
    names = ", ".join(sorted(n.get("NodeManagerAddress", n.get("NodeID", "?"))
                             for n in prefill_nodes))
    raise ValueError(
        f"--kv-store {store_url} is a directory local to each machine, but prefill workers may "
        f"be placed on {len(prefill_nodes)} Ray nodes ({names}); use a Redis store "
        f"(--kv-store redis://HOST:PORT/0), a path every node mounts (with --kv-store-shared), "
        f"--kv-store none, or pin prefill workers to one node with --prefill-resources")


def _route_ip_to(host: str) -> str:
    """This machine's address on the route to `host` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(host), 9))
        return s.getsockname()[0]


def connect_ray(address: str | None, init_kwargs: dict | None = None) -> bool:
    """Connect this process to Ray unless it already is (an already initialised Ray,
    `address`, RAY_ADDRESS, a cluster started with `ray start` here, else a new local one).
    True when this call connected (the caller then shuts Ray down on close)."""
    import ray
    if ray.is_initialized():
        return False
    kwargs = dict(init_kwargs or {})
    if address is not None:
        kwargs["address"] = address
    # The head's Ray Client server starts one server process per client; that start now and
    # then never answers (a forked child stuck before exec on a loaded head) and fails the
    # whole connection. It is the head's transient fault, not a wrong address: try again.
    attempts = RAY_CLIENT_ATTEMPTS if address is not None and address.startswith("ray://") else 1
    for attempt in range(1, attempts + 1):
        try:
            ray.init(**kwargs)
            return True
        except (ConnectionError, TimeoutError) as exc:
            if attempt < attempts and "Initialization failure from server" in str(exc):
                logger.warning("Ray Client server at %s failed to start a server for us "
                               "(attempt %d of %d): trying again", address, attempt, attempts)
                continue
            _raise_cannot_connect(address, exc)
    return True


def _raise_cannot_connect(address: str | None, exc: Exception) -> None:
    where = address or os.environ.get("RAY_ADDRESS")
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    # Ray Client puts the server's traceback after its first line: keep its last line too.
    reason = " ... ".join(dict.fromkeys([lines[0], lines[-1]])) if lines else type(exc).__name__
    raise ValueError(f"cannot connect to Ray at {where}: {reason}") from None


def front_host_for(address: str | None, front_host: str | None) -> str:
    """Where the front binds its sockets: `front_host` when given; through Ray Client the
    driver runs here, so this machine's address towards the head; else this node's IP."""
    import ray
    if front_host is not None:
        return front_host
    if address is not None and address.startswith("ray://"):
        return _route_ip_to(address[len("ray://"):].rsplit(":", 1)[0])
    return ray.util.get_node_ip_address()


def connect_actors(address: str | None, front_host: str | None, init_kwargs: dict | None,
                   actor_cls) -> tuple[bool, bool, str, object]:
    """Connect (`connect_ray`) and declare `actor_cls` as every DeepInfer actor: Ray never
    restarts it (the front's supervisor does), threaded. -> (whether this call connected,
    whether the cluster has GPUs, the front's bind address, the remote class)."""
    import ray
    owns_ray = connect_ray(address, init_kwargs)
    has_gpus = ray.cluster_resources().get("GPU", 0) > 0
    host = front_host_for(address, front_host)
    from deepinfer.wire.secret import SECRET_ENV, ensure_cluster_secret
    # The frame-signing secret reaches the actors through their environment (not argv).
    actor_class = ray.remote(max_restarts=0, max_task_retries=0,
                             max_concurrency=ACTOR_MAX_CONCURRENCY,
                             runtime_env={"env_vars": {SECRET_ENV: ensure_cluster_secret()}}
                             )(actor_cls)
    return owns_ray, has_gpus, host, actor_class


def disconnect_ray(owns_ray: bool) -> None:
    """Shut Ray down if `connect_ray` connected this process (not a Ray someone else runs)."""
    import ray
    if owns_ray and ray.is_initialized():
        ray.shutdown()


class RayLauncher:
    """Connects to Ray (an already initialised Ray, `address`, RAY_ADDRESS, a cluster started
    with `ray start` on this machine, else a new local one) and places workers as actors."""

    name = "ray"

    def __init__(self, address: str | None = None, role_resources: dict | None = None,
                 kv_store_shared: bool = False, front_host: str | None = None,
                 init_kwargs: dict | None = None) -> None:
        role_resources = dict(role_resources or {})
        unknown = set(role_resources) - set(CLUSTER_ROLES)
        if unknown:
            raise ValueError(f"no worker role {sorted(unknown)}; roles: {CLUSTER_ROLES}")
        self.role_resources = {r: role_resources.get(r) or RoleResources() for r in CLUSTER_ROLES}
        self.kv_store_shared = kv_store_shared
        self.address = address
        self._owns_ray, self._has_gpus, self._front_host, self._actor_class = connect_actors(
            address, front_host, init_kwargs, WorkerActor)

    def front_host(self) -> str:
        """Where the front binds its sockets: an address every worker node can reach."""
        return self._front_host

    def role_request(self, role: str) -> dict[str, float]:
        return self.role_resources[role].request(self._has_gpus)

    def check(self, cluster) -> None:
        """Refuse what cannot work: a role no alive node can host (the actor would wait
        forever), a node-local fs store shared by prefill workers on several nodes."""
        import ray
        if getattr(cluster, "cpu_affinity", False):
            raise ValueError("--cpu-affinity pins cores of this machine; on Ray a worker's "
                             "cores come from num_cpus in --prefill/--decode-resources")
        nodes = ray.nodes()
        for role in CLUSTER_ROLES:
            if not nodes_that_fit(self.role_request(role), nodes):
                raise ValueError(f"no alive Ray node can host a {role} worker asking for "
                                 f"{self.role_request(role)}; cluster resources: "
                                 f"{ray.cluster_resources()}")
        check_store_locality(cluster.store_url, self.kv_store_shared or cluster.kv_store_shared,
                             nodes_that_fit(self.role_request("prefill"), nodes))

    def process(self, spec: WorkerSpec) -> RayWorkerProcess:
        options = self.role_resources[spec.role].actor_options(self._has_gpus)
        return RayWorkerProcess(self._actor_class, spec, options)

    def pending_reason(self, proc: RayWorkerProcess) -> str | None:
        """Why a started actor does not run yet, when Ray lacks the resources for it now (it
        starts when they appear: a worker leaving, an autoscaler adding a node)."""
        import ray
        if proc.info is not None or not proc.is_alive():
            return None
        request = self.role_request(proc.spec.role)
        available = ray.available_resources()
        short = {k: v for k, v in request.items() if available.get(k, 0.0) < v}
        if not short:
            return None
        return (f"waiting for Ray resources {request} (available now: "
                f"{ {k: available.get(k, 0.0) for k in short} })")

    def placement(self, proc: RayWorkerProcess) -> dict:
        return {"launcher": self.name, **(proc.info or {}), "resources": proc._options}

    def close(self) -> None:
        disconnect_ray(self._owns_ray)
