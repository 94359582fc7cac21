"""`WorkerLoad`: the snapshot every worker publishes and every router decides from. Pure.

Workers send one at a fixed interval and on every change of state; routers never read a
worker's state any other way (which is also how the simulator drives them).
"""
from __future__ import annotations

from dataclasses import dataclass

WORKER_ROLES = ("prefill", "decode", "colocated", "encode")


@dataclass(frozen=True)
class WorkerLoad:
    """One worker's load at `timestamp` (seconds on the router's clock; see `ReservationLedger`).

    `kv_tokens` is the accumulated KV length of the worker's running requests; the KV capacity
    in tokens is `num_kv_blocks_total * block_size`. `predicted_queue_time_s` is the worker's
    own estimate (cost model) of the time to drain its queued prefill work, or None when the
    worker has no cost model. `kv_staged_bytes` / `kv_staging_capacity_bytes`: a prefill
    worker's host memory holding prompt KV until decode workers pull it (staged plus promised
    to prompts it has admitted) and its cap (None: no cap reported); a worker whose staging is
    full holds new prompts back, so the prefill router sends them elsewhere when it can.
    `store_load_s_per_token`: a prefill worker's measured time to load one token's KV from
    the shared store (None: not measured), for the router's load-or-recompute choice.
    `compute_s_per_token`: its measured prefill seconds per computed token (None: not
    measured), which calibrates the router's prefill cost model to this worker's speed.
    """

    worker_id: str
    role: str
    timestamp: float
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_queued_uncached_tokens: int = 0
    num_kv_blocks_used: int = 0
    num_kv_blocks_total: int = 0
    block_size: int = 16
    kv_tokens: int = 0
    max_running_reqs: int = 256
    predicted_queue_time_s: float | None = None
    healthy: bool = True
    kv_staged_bytes: int = 0
    kv_staging_capacity_bytes: int | None = None
    store_load_s_per_token: float | None = None
    compute_s_per_token: float | None = None

    def __post_init__(self) -> None:
        if not self.worker_id:
            raise ValueError("worker_id must be a non-empty string")
        if self.role not in WORKER_ROLES:
            raise ValueError(f"role must be one of {WORKER_ROLES}, got {self.role!r}")
        for name in ("num_running_reqs", "num_waiting_reqs", "num_queued_uncached_tokens",
                     "num_kv_blocks_used", "num_kv_blocks_total", "kv_tokens", "kv_staged_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_running_reqs < 1:
            raise ValueError(f"max_running_reqs must be >= 1, got {self.max_running_reqs}")
        if self.predicted_queue_time_s is not None and self.predicted_queue_time_s < 0:
            raise ValueError("predicted_queue_time_s must be >= 0 or None")
        if self.store_load_s_per_token is not None and self.store_load_s_per_token < 0:
            raise ValueError("store_load_s_per_token must be >= 0 or None")
        if self.compute_s_per_token is not None and self.compute_s_per_token < 0:
            raise ValueError("compute_s_per_token must be >= 0 or None")
        if self.kv_staging_capacity_bytes is not None and self.kv_staging_capacity_bytes < 1:
            raise ValueError("kv_staging_capacity_bytes must be >= 1 or None")

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_blocks_total * self.block_size

    @property
    def staging_full(self) -> bool:
        """No room left to stage another prompt's KV (a prefill worker's back-pressure)."""
        return (self.kv_staging_capacity_bytes is not None
                and self.kv_staged_bytes >= self.kv_staging_capacity_bytes)

    @property
    def num_active_reqs(self) -> int:
        """Requests the worker holds: running plus waiting (queued or receiving KV)."""
        return self.num_running_reqs + self.num_waiting_reqs
