"""A simulated worker: the engine's own Scheduler and KVCacheManager, no model runner. Pure.

The worker holds what the real worker loop holds between steps (inputs not yet handled,
prompts waiting for decode blocks, transfers in flight) and builds the same `WorkerLoad`
snapshot (`cluster.worker_loop.WorkerLoop.load_report`). The simulator drives it.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from deepinfer.core.compute_budget import ComputeAwarePolicy
from deepinfer.core.cost_model import ChunkShape, CostModel, RateEstimator
from deepinfer.core.kv_cache_manager import KVCacheManager
from deepinfer.core.scheduler import Scheduler, SchedulerConfig
from deepinfer.core.scheduler_output import SchedulerOutput
from deepinfer.core.step_budget import StepBudgetPolicy, TokenBudgetPolicy
from deepinfer.routing import WorkerLoad
from deepinfer.sim.cluster_spec import EngineSpec
from deepinfer.sim.step_time import StepTimeModel

MIN_CHUNK_TOKENS = 32  # as runtime.budget_factory (which imports torch)


def build_budget_policy(engine: EngineSpec, cost_model: CostModel) -> StepBudgetPolicy:
    """The policy `runtime.budget_factory.build_step_budget_policy` builds for these knobs."""
    if engine.scheduler == "token-budget":
        return TokenBudgetPolicy(engine.max_num_batched_tokens)
    if engine.step_time_budget_ms is None:
        budget_s = cost_model.predict([ChunkShape(0, engine.max_num_batched_tokens)])
    else:
        budget_s = engine.step_time_budget_ms / 1e3
    min_chunk = -(-MIN_CHUNK_TOKENS // engine.block_size) * engine.block_size
    return ComputeAwarePolicy(cost_model, budget_s, block_size=engine.block_size,
                              min_chunk_tokens=min_chunk,
                              max_num_batched_tokens=engine.max_num_batched_tokens)


def build_scheduler(engine: EngineSpec, cost_model: CostModel) -> Scheduler:
    kv = KVCacheManager(engine.num_kv_blocks, engine.block_size, engine.enable_prefix_caching)
    return Scheduler(SchedulerConfig(engine.max_num_seqs, engine.max_model_len),
                     kv, build_budget_policy(engine, cost_model))


@dataclass
class Handoff:
    """A prefilled request on its way to a decode worker (the `DecodeRequest` message)."""

    request_id: str
    first_token_id: int


@dataclass
class SimWorker:
    worker_id: str
    role: str  # colocated | prefill | decode
    engine: EngineSpec
    scheduler: Scheduler
    step_model: StepTimeModel
    inbox: deque = field(default_factory=deque)  # new requests / handoffs not yet handled
    waiting_alloc: deque = field(default_factory=deque)  # decode: handoffs without blocks
    transferring: dict = field(default_factory=dict)  # decode: request id -> prompt tokens
    busy: bool = False
    output: SchedulerOutput | None = None
    step_time_s: float = 0.0
    stall_s: float = 0.0  # blocking work before the next step (store loads)
    # Host sharing (processor sharing of the step in flight): work left at full speed, the
    # speed since `speed_since_s`, and a version that invalidates superseded finish events.
    step_started_s: float = 0.0
    work_left_s: float = 0.0
    speed: float = 1.0
    speed_since_s: float = 0.0
    step_version: int = 0
    busy_time_s: float = 0.0  # simulated time in steps (stretched by host sharing)
    work_time_s: float = 0.0  # the steps' work at full speed: a worker's CPU seconds on a CPU
    num_steps: int = 0
    peak_kv_usage: float = 0.0
    last_load: WorkerLoad | None = None
    # prefill: the rate it reports (`compute_s_per_token`), which the least-compute router
    # scales its costs by; measured on the steps' simulated wall time, so host sharing that
    # slows one worker's steps steers requests away from it as in the engine.
    compute_rate: RateEstimator | None = None

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def load(self, now: float) -> WorkerLoad:
        """The snapshot the real worker reports (`WorkerLoop.load_report` + `extra_load`)."""
        sched = self.scheduler
        kv = sched.kv
        queued = sum(r.num_tokens - r.num_computed_tokens for r in sched.waiting)
        queued += sum(r.num_tokens - r.num_computed_tokens - 1 for r in sched.running
                      if r.num_tokens - r.num_computed_tokens > 1)
        extra_reqs = len(self.waiting_alloc) + len(self.transferring)
        extra_kv = sum(self.transferring.values()) + sum(n for _, n in self.waiting_alloc)
        return WorkerLoad(
            worker_id=self.worker_id, role=self.role, timestamp=now,
            num_running_reqs=sched.num_running, num_waiting_reqs=sched.num_waiting + extra_reqs,
            num_queued_uncached_tokens=queued, num_kv_blocks_used=kv.pool.num_used_blocks,
            num_kv_blocks_total=kv.num_blocks, block_size=kv.block_size,
            kv_tokens=sum(r.num_tokens for r in sched.running) + extra_kv,
            max_running_reqs=sched.config.max_num_seqs,
            compute_s_per_token=(self.compute_rate.s_per_unit if self.compute_rate is not None
                                 and self.compute_rate.num_samples else None))

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()
