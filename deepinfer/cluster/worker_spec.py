"""`WorkerSpec`: everything a prefill/decode worker process needs to start. Plain data."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deepinfer.engine.engine_config import EngineConfig

CLUSTER_ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class WorkerSpec:
    """`input_addr` / `output_addr`: the front's bound PUSH (to this worker) and PULL (from
    every worker) TCP addresses. `kv_store_url`: the shared prefix store (prefill workers;
    None disables it). `debug_transfer_delay_s` delays every KV fetch of a decode worker
    (fault injection for tests: widens the window between prefill and decode).
    `max_staged_bytes`: host memory a prefill worker may hold for decode pulls. `cpu_ids`:
    cores the process pins itself to (None: any)."""

    worker_id: str
    role: str
    engine_config: EngineConfig
    input_addr: str
    output_addr: str
    parent_pid: int | None = None
    kv_store_url: str | None = None
    report_interval_s: float = 0.2
    transfer_timeout_s: float = 10.0
    kv_stage_ttl_s: float = 30.0
    host: str = "127.0.0.1"
    log_level: str = "WARNING"
    debug_transfer_delay_s: float = 0.0
    max_staged_bytes: int = 2 * 1024**3
    cpu_ids: tuple[int, ...] | None = None  # --cpu-affinity: the cores this worker may use
    # A rank of an EP decode group: an object with `build(spec, input_socket, output_socket)`
    # -> (engine, loop, transport, tier), e.g. deepinfer.ep.decode_rank.EPRankSpec.
    ep_rank: Any = None

    def __post_init__(self) -> None:
        if self.role not in CLUSTER_ROLES:
            raise ValueError(f"role must be one of {CLUSTER_ROLES}, got {self.role!r}")
        if self.report_interval_s <= 0 or self.transfer_timeout_s <= 0 or self.kv_stage_ttl_s <= 0:
            raise ValueError("report interval, transfer timeout and stage TTL must be positive")
        if self.max_staged_bytes < 1:
            raise ValueError("max_staged_bytes must be positive")
