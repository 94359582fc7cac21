"""`ClusterConfig`: shape and timeouts of a disaggregated deployment. Plain data, no IO."""
from __future__ import annotations

from dataclasses import dataclass

from deepinfer.cluster.worker_supervisor import RestartPolicy
from deepinfer.routing.policy_names import check_router_names


@dataclass(frozen=True)
class ClusterConfig:
    """P prefill + D decode worker processes behind one front.

    `kv_store_url`: shared prefix store (`kvstore.open_store` URL; "none" disables it).
    `heartbeat_timeout_s`: a worker silent this long is removed from routing (it reports
    every `report_interval_s`). `stall_timeout_s`: a request with no progress this long is
    failed (last resort: nothing waits forever) and aborted on every worker holding state for
    it. `loop_stall_timeout_s`: a worker whose engine loop has not advanced this long (its
    heartbeats say so) is suspended from routing like a silent one, until its loop advances
    again; it must exceed the longest legitimate step. `hung_restart_after_s`: a worker
    suspended this long is declared lost (killed; restarted per the restart policy).
    `max_staged_bytes`: host memory each prefill worker may hold for decode pulls (prompts
    wait, and the prefill router looks elsewhere, beyond it). `debug_transfer_delay_s`: fault
    injection, delays every KV pull (tests). `max_worker_restarts`: a lost worker is restarted after a
    back-off doubling from `restart_backoff_s` up to `restart_backoff_max_s`, at most this
    many times in a row (0: never); `restart_stable_after_s` of service resets the count."""

    num_prefill_workers: int = 1
    num_decode_workers: int = 1
    kv_store_url: str | None = "fs"
    prefill_router: str = "least-compute"
    decode_router: str = "balanced"
    report_interval_s: float = 0.2
    heartbeat_timeout_s: float = 3.0
    transfer_timeout_s: float = 10.0
    kv_stage_ttl_s: float = 30.0
    stall_timeout_s: float = 120.0
    ready_timeout_s: float = 600.0
    host: str = "127.0.0.1"
    log_level: str = "WARNING"
    debug_transfer_delay_s: float = 0.0
    loop_stall_timeout_s: float = 30.0
    hung_restart_after_s: float = 60.0
    max_staged_bytes: int = 2 * 1024**3
    max_worker_restarts: int = 5
    restart_backoff_s: float = 0.5
    restart_backoff_max_s: float = 30.0
    restart_stable_after_s: float = 60.0
    cpu_affinity: bool = False  # pin each worker process to its own cores
    kv_store_shared: bool = False  # an fs store path every node mounts (multi-node)
    drain_timeout_s: float = 120.0  # a worker removed by scaling finishes its requests first
    # E/P/D: encode workers run the vision tower; their embeddings reach prefill workers
    # through the shared store (0: prefill workers encode images themselves).
    num_encode_workers: int = 0
    encode_router: str = "least-patches"
    encode_cache_bytes: int = 1 << 30  # each encode worker's LRU of embeddings

    def __post_init__(self) -> None:
        if self.num_prefill_workers < 1 or self.num_decode_workers < 1:
            raise ValueError("need at least one prefill and one decode worker")
        check_router_names(self.prefill_router, self.decode_router)
        if self.num_encode_workers < 0:
            raise ValueError("num_encode_workers must be >= 0")
        if self.num_encode_workers and self.store_url is None:
            raise ValueError("--encode-workers needs a shared store (--kv-store fs or redis): "
                             "prefill workers fetch image embeddings from it")
        if self.heartbeat_timeout_s <= self.report_interval_s:
            raise ValueError("heartbeat_timeout_s must exceed report_interval_s")
        for name in ("transfer_timeout_s", "kv_stage_ttl_s", "stall_timeout_s",
                     "loop_stall_timeout_s", "hung_restart_after_s", "max_staged_bytes",
                     "drain_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        self.restart_policy  # validates the restart fields

    @property
    def restart_policy(self) -> RestartPolicy:
        return RestartPolicy(
            initial_backoff_s=self.restart_backoff_s, max_backoff_s=self.restart_backoff_max_s,
            max_restarts=self.max_worker_restarts, stable_after_s=self.restart_stable_after_s,
            ready_timeout_s=self.ready_timeout_s)

    @property
    def store_url(self) -> str | None:
        return None if self.kv_store_url in (None, "none") else self.kv_store_url
