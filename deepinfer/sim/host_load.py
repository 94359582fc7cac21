"""CPU on the host besides the workers' steps: front door, bench client, KV transfers. Pure.

On a host whose workers share CPU cores (`host: {cores: N}`), the workers are not the only
busy threads: the front door (`deepinfer serve`'s main process: routing, handoffs,
detokenizing, SSE), the load generator, and the KV transport's threads at both ends of a
disaggregated transfer take CPU from the same cores. Each is a `CpuJob`: one thread with a
FIFO of work items (seconds at full speed), counted as one busy thread while it has work,
advancing under the same processor sharing as the workers' steps (`simulator._speed`).

The costs are data in the cluster spec's `host` section, measured on the host
(`benchmarks/sim_validation_calibration.py` for the front and client, `deepinfer profile`'s
`kv_transport.cpu_s_per_gb` for transfers), never fitted to a trace:

    host: {cores: 2,
           front_cpu:  {per_request_s: 4e-3, per_token_s: 2e-4, per_handoff_s: 3e-3},
           client_cpu: {per_request_s: 3e-3, per_token_s: 1e-4},
           kv_transfer_cpu_s_per_gb: {sender: 0.7, receiver: 0.7}}

Absent (the default), no job exists and a run is bit-equal to one without this module.
A transfer with CPU costs lands when the link's floor (latency + bytes / bandwidth, one at a
time per destination) has passed and both ends' CPU work is done.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class CpuCost:
    """CPU seconds at full speed per unit of traffic one process handles."""

    per_request_s: float = 0.0
    per_token_s: float = 0.0
    per_handoff_s: float = 0.0  # the front only: a P/D handoff (prefill done -> decode)

    def __post_init__(self) -> None:
        for name in ("per_request_s", "per_token_s", "per_handoff_s"):
            value = getattr(self, name)
            if not 0.0 <= value < 10.0:
                raise ValueError(f"{name} must be in [0, 10) seconds, got {value}")


@dataclass(frozen=True)
class HostCpuSpec:
    """The background CPU consumers of a host (see the module docstring)."""

    front: CpuCost | None = None
    client: CpuCost | None = None
    kv_send_s_per_gb: float = 0.0  # the prefill (sending) end, per GB transferred
    kv_recv_s_per_gb: float = 0.0  # the decode (receiving) end
    # a P/D prefill worker's own CPU per handed-off request beyond its profiled step (its
    # handoff path), charged to its next step like the store publishing
    prefill_per_handoff_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("kv_send_s_per_gb", "kv_recv_s_per_gb"):
            value = getattr(self, name)
            if not 0.0 <= value < 1000.0:
                raise ValueError(f"kv_transfer_cpu_s_per_gb must be in [0, 1000), got {value}")
        if not 0.0 <= self.prefill_per_handoff_s < 10.0:
            raise ValueError("prefill_cpu.per_handoff_s must be in [0, 10) seconds")

    @property
    def charges_transfers(self) -> bool:
        return self.kv_send_s_per_gb > 0 or self.kv_recv_s_per_gb > 0


HOST_CPU_KEYS = {"front_cpu", "client_cpu", "kv_transfer_cpu_s_per_gb", "prefill_cpu"}


def host_cpu_from_dict(host: dict) -> HostCpuSpec | None:
    """The `host` section's CPU-consumer keys as a spec (None when it names none)."""
    if not HOST_CPU_KEYS & set(host):
        return None

    def cost(key: str, allowed: set[str]) -> CpuCost | None:
        data = host.get(key)
        if data is None:
            return None
        if not isinstance(data, dict):
            raise ValueError(f"host.{key} must be a mapping")
        unknown = set(data) - allowed
        if unknown:
            raise ValueError(f"host.{key}: unknown keys {sorted(unknown)}; "
                             f"allowed: {sorted(allowed)}")
        return CpuCost(**{k: _seconds(f"host.{key}.{k}", v) for k, v in data.items()})

    base = {"per_request_s", "per_token_s"}
    kv = host.get("kv_transfer_cpu_s_per_gb") or {}
    if not isinstance(kv, dict) or set(kv) - {"sender", "receiver"}:
        raise ValueError("host.kv_transfer_cpu_s_per_gb must be {sender: s, receiver: s}")
    prefill = host.get("prefill_cpu") or {}
    if not isinstance(prefill, dict) or set(prefill) - {"per_handoff_s"}:
        raise ValueError("host.prefill_cpu must be {per_handoff_s: s}")
    return HostCpuSpec(front=cost("front_cpu", base | {"per_handoff_s"}),
                       client=cost("client_cpu", base),
                       kv_send_s_per_gb=_seconds("host.kv_transfer_cpu_s_per_gb.sender",
                                                 kv.get("sender", 0.0)),
                       kv_recv_s_per_gb=_seconds("host.kv_transfer_cpu_s_per_gb.receiver",
                                                 kv.get("receiver", 0.0)),
                       prefill_per_handoff_s=_seconds("host.prefill_cpu.per_handoff_s",
                                                      prefill.get("per_handoff_s", 0.0)))


def _seconds(where: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where} must be a number of seconds, got {value!r}")
    return float(value)


@dataclass
class CpuJob:
    """One background thread: FIFO items [work left at full speed (s), callback or None]."""

    name: str
    items: deque = field(default_factory=deque)
    speed: float = 1.0
    speed_since_s: float = 0.0
    version: int = 0  # invalidates superseded finish events
    work_s: float = 0.0  # all work given (CPU seconds at full speed)
    threads: int = 1

    @property
    def busy(self) -> bool:
        return bool(self.items)

    def add(self, work_s: float, on_done: Callable[[], None] | None = None) -> bool:
        """Queue work; True when the job was idle (a new busy thread: speeds change)."""
        was_idle = not self.items
        self.work_s += work_s
        if self.items and len(self.items) > 1 and on_done is None and self.items[-1][1] is None:
            self.items[-1][0] += work_s  # merge into the queued tail: one event fewer
        else:
            self.items.append([work_s, on_done])
        return was_idle

    def advance(self, now: float) -> None:
        """Bring the head item's remaining work up to `now` at the current speed."""
        if self.items:
            head = self.items[0]
            head[0] = max(0.0, head[0] - (now - self.speed_since_s) * self.speed)
        self.speed_since_s = now

    def head_left_s(self) -> float:
        return self.items[0][0]


class HostLoad:
    """The jobs of one simulated host, created on first use (per-worker KV ends by name)."""

    def __init__(self, spec: HostCpuSpec) -> None:
        self.spec = spec
        self.jobs: dict[str, CpuJob] = {}

    def job(self, name: str) -> CpuJob:
        job = self.jobs.get(name)
        if job is None:
            job = self.jobs[name] = CpuJob(name)
        return job

    def busy_threads(self) -> int:
        return sum(j.threads for j in self.jobs.values() if j.busy)

    def on_arrival(self) -> list[tuple[str, float]]:
        """(job, work) for one request arriving at the front door."""
        return self._per("per_request_s", 1)

    def on_tokens(self, num_tokens: int) -> list[tuple[str, float]]:
        """(job, work) for tokens streamed by the front and received by the client."""
        return self._per("per_token_s", num_tokens) if num_tokens else []

    def on_handoff(self) -> list[tuple[str, float]]:
        front = self.spec.front
        return [("front", front.per_handoff_s)] if front and front.per_handoff_s > 0 else []

    def _per(self, attr: str, count: int) -> list[tuple[str, float]]:
        out = []
        for name, cost in (("front", self.spec.front), ("client", self.spec.client)):
            work = getattr(cost, attr) * count if cost is not None else 0.0
            if work > 0:
                out.append((name, work))
        return out

    def transfer_work(self, num_bytes: float) -> tuple[float, float]:
        """(sender, receiver) CPU seconds for one KV transfer of `num_bytes`."""
        gb = num_bytes / 1e9
        return self.spec.kv_send_s_per_gb * gb, self.spec.kv_recv_s_per_gb * gb

    def work_s(self) -> dict[str, float]:
        """CPU seconds at full speed given to each job (compare with measured process CPU)."""
        return {name: job.work_s for name, job in self.jobs.items()}
