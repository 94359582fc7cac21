"""`WorkerHandle`: the front's view of one worker process (socket, readiness, load, health)."""
from __future__ import annotations

import multiprocessing
from dataclasses import dataclass, field

from deepinfer.wire.worker_messages import WorkerCounters, WorkerLoadReport, WorkerReady
from deepinfer.cluster.worker_channels import WorkerInput
from deepinfer.cluster.worker_spec import WorkerSpec
from deepinfer.routing import WorkerLoad
from deepinfer.wire import ChannelSender, channel_name


@dataclass
class WorkerHandle:
    spec: WorkerSpec
    input_socket: WorkerInput  # the front's ROUTER to it (sends only once it said hello)
    proc: multiprocessing.process.BaseProcess | None = None
    ready: WorkerReady | None = None
    alive: bool = True
    last_seen: float = 0.0
    load: WorkerLoad | None = None
    last_report: WorkerLoadReport | None = None
    counters: WorkerCounters = field(default_factory=WorkerCounters)
    request_ids: set[str] = field(default_factory=set)  # requests the front placed here
    dead_reason: str | None = None  # why it is out of routing
    suspended_since: float | None = None  # unresponsive (not lost): may resume
    last_loop_advance: float = 0.0  # when its engine loop last finished an iteration
    sender: ChannelSender = field(init=False)  # signs what the front sends it

    def __post_init__(self) -> None:
        self.sender = ChannelSender(channel_name("worker.input", self.spec.input_addr))

    @property
    def worker_id(self) -> str:
        return self.spec.worker_id

    @property
    def role(self) -> str:
        return self.spec.role

    def to_worker_load(self, report: WorkerLoadReport, now: float) -> WorkerLoad:
        return WorkerLoad(
            worker_id=self.worker_id, role=self.role, timestamp=now,
            num_running_reqs=report.num_running_reqs, num_waiting_reqs=report.num_waiting_reqs,
            num_queued_uncached_tokens=report.num_queued_uncached_tokens,
            num_kv_blocks_used=report.num_kv_blocks_used,
            num_kv_blocks_total=report.num_kv_blocks_total, block_size=report.block_size,
            kv_tokens=report.kv_tokens, max_running_reqs=report.max_running_reqs,
            healthy=self.alive, kv_staged_bytes=report.kv_staged_bytes,
            kv_staging_capacity_bytes=report.kv_staging_capacity_bytes or None,
            store_load_s_per_token=report.store_load_s_per_token,
            compute_s_per_token=report.compute_s_per_token)
