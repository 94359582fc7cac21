"""`ClusterSimulator`: a discrete-event run of the engine's schedulers and routers. Pure.

Each worker is the engine's `Scheduler` + `KVCacheManager` (`sim_worker`); the front is the
engine's prefill and decode routers fed with the same `WorkerLoad` snapshots the real workers
publish (after every step and on every input). Where the engine runs the model, the
simulator asks a step-time model (a measured cost profile or a roofline) how long the step
takes, then applies a `StepResult` with one sampled token per finished chunk.

Life of a request, as in `cluster/`: arrival → prefill router → prefill worker (shared store
blocks loaded into its device cache before queuing; blocking, at store bandwidth) → first
token → KV staged, prompt blocks written through to the store (background; the worker's CPU
for publishing them, as measured, is added to its next step) → decode router →
decode worker allocates (FIFO while full) → KV transfer (latency + bytes / bandwidth, one at a
time per destination) → running decode until `output_len` tokens. Colocated: arrival →
router (when there are several instances) → one scheduler does everything. When the prefill
router plans to *await* a prefix (computed by another worker, or just published), the
request is held at its worker, as the real one holds it, until those blocks are in the store
or the plan's deadline passes, then admitted with what the store has.

Host contention: with `host_cores`, busy workers share the cores. `fair` (processor
sharing): while the busy workers' threads exceed the cores, each step advances at cores /
busy threads of its full speed, re-evaluated whenever a worker starts or finishes a step (the
CPU validation runs four single-thread workers on two cores). `measured`: the same, at the
speed `deepinfer profile --host-sharing N` measured for that many busy single-thread
processes on the host (SMT, caches, memory bandwidth; beyond the table: its last entry ×
N / threads). `at-start`: a step's speed is fixed when it starts (cores / threads busy then)
and never changes; it favours whichever step started first, kept to compare with
measurements. A step's work is its step-time model's answer
(model time + the engine loop's host work) plus blocking store loads. The host's other CPU
consumers (front door, client, both ends of a KV transfer: `sim.host_load`, when the cluster's
`host` section gives their costs) count as busy threads in the same sharing. With
`host.time_sharing` (`sim.time_sharing`), while those threads exceed the cores each step also
advances at its kind's efficiency (a time-shared core refills its caches at every switch);
`work_time_s` stays the work at full speed, `cpu_time_s` adds what time-sharing costs. With
`host.memory_contention` (`sim.memory_contention`) a small decode step also advances at the
measured factor while another worker runs a decode (or else a prefill) step on another core
(they share the memory bandwidth), re-evaluated for every worker whenever any starts or
finishes a step (under `at-start` too). Time is simulated; nothing reads the clock.

Noise (`cluster.noise`, `sim.perturbation`): each step's time (the step-time model's answer;
not store loads) × a seeded mean-1 factor per worker, and each arrival a seeded lag late;
without it (or at zero) the run is the deterministic one, bit for bit.
"""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

from deepinfer.bench.workloads import BenchRequest
from deepinfer.core.cost_model import ChunkShape, prefill_compute_rate
from deepinfer.core.prefix_hash import hash_request_blocks
from deepinfer.core.request import Request, RequestStatus
from deepinfer.core.scheduler_output import StepResult
from deepinfer.routing import (NoWorkerAvailable, RoutingRequest, build_decode_router,
                               build_prefill_router)
from deepinfer.sampling_params import SamplingParams
from deepinfer.sim.cluster_spec import ClusterSpec
from deepinfer.sim.host_load import CpuJob, HostLoad
from deepinfer.sim.perturbation import StepNoise, jitter_arrivals
from deepinfer.sim.prefix_store import SimPrefixStore
from deepinfer.sim.sim_request import SimRequest
from deepinfer.sim.sim_worker import Handoff, SimWorker, build_scheduler
from deepinfer.sim.step_time import build_step_time
from deepinfer.sim.memory_contention import MemoryContention, memory_contention_from_dict
from deepinfer.sim.time_sharing import TimeSharing, time_sharing_from_dict

SAMPLED_TOKEN_ID = 1  # any id: requests stop on max_tokens (ignore_eos), as `bench serve` asks


MEASUREMENT_NOISE = 1.1  # a measured efficiency up to this is read as 1.0 (see below)


def measured_at_most_one(data: dict) -> dict:
    """A profile's measured efficiencies, with ratios in (1, 1.1] read as 1: sharing never speeds
    a step up, so a ratio a little over 1 is the measurement's noise (profiles written before the
    profiler clamped them would otherwise be refused); larger ones stay errors."""
    def read(v):
        number = isinstance(v, (int, float)) and not isinstance(v, bool)
        return 1.0 if number and 1.0 < v <= MEASUREMENT_NOISE else v
    return {k: read(v) for k, v in data.items()}


class ClusterSimulator:
    def __init__(self, cluster: ClusterSpec, *, check_invariants: bool = False) -> None:
        self.cluster = cluster
        self.check = check_invariants
        self.workers: dict[str, SimWorker] = {}
        self.pools: dict[str, list[SimWorker]] = {}
        self.step_time_cv: dict[str, float] = {}  # per pool: the noise applied (0: none)
        self._step_noise: dict[str, StepNoise] = {}
        for pool in cluster.pools:
            step_model, cost_model = build_step_time(pool.cost)
            self.pools[pool.role] = []
            noise = cluster.noise
            self.step_time_cv[pool.role] = (noise.step_cv_for(cost_model.metadata)
                                            if noise is not None else 0.0)
            for i in range(pool.num_workers):
                # A roofline worker with expert_load keeps its own loads and EPLB placement.
                own_model = getattr(step_model, "for_worker", lambda _: step_model)(i)
                worker = SimWorker(f"{pool.role}-{i}", pool.role, pool.engine,
                                   build_scheduler(pool.engine, cost_model), own_model)
                if self.step_time_cv[pool.role]:
                    self._step_noise[worker.worker_id] = StepNoise(
                        self.step_time_cv[pool.role], noise.seed, worker.worker_id)
                if pool.role == "prefill":
                    worker.compute_rate = prefill_compute_rate()
                self.workers[worker.worker_id] = worker
                self.pools[pool.role].append(worker)
        self.prefill_router = build_prefill_router(cluster.prefill_router)
        self.decode_router = build_decode_router(cluster.decode_router)
        self.store = (SimPrefixStore(cluster.prefix_store.capacity_blocks)
                      if cluster.prefix_store is not None and cluster.disaggregated else None)
        self.requests: dict[str, SimRequest] = {}
        self.now = 0.0
        self._events: list = []
        self._seq = itertools.count()
        self._link_free_at: dict[str, float] = {}  # per decode worker: inbound KV link
        # Requests held at a prefill worker until an awaited prefix is in the store:
        # request id -> (worker, record, the block hashes awaited).
        self._awaiting: dict[str, tuple[SimWorker, SimRequest, list[bytes]]] = {}
        self.num_awaited = 0
        self.num_transfers = 0
        self.transfer_bytes = 0.0
        self._speed_table = self._measured_speeds() if cluster.host_sharing == "measured" else None
        self.time_sharing = self._time_sharing()
        self.memory_contention = self._memory_contention()
        # Per worker under memory contention: its step's kind, and its speed before the
        # contention factor with the time-sharing efficiency in it (set when it is reshared).
        self._step_kind: dict[str, str] = {}
        self._base_speed: dict[str, tuple[float, float]] = {}
        # Per worker: the step's efficiency when time-shared, the one in effect since
        # `speed_since_s`, and the CPU seconds its steps cost (work / efficiency).
        self._step_efficiency: dict[str, float] = {}
        self._efficiency_now: dict[str, float] = {}
        self.cpu_time_s: dict[str, float] = {w: 0.0 for w in self.workers}
        # Front door, client and KV-transfer threads on the same cores (None: not modelled).
        self.host_load = HostLoad(cluster.host_cpu) if cluster.host_cpu is not None else None
        for worker in self.workers.values():
            self._publish(worker)

    def _measured_speeds(self) -> list[float]:
        """The host-sharing speed table of the (first) measured profile."""
        for worker in self.workers.values():
            metadata = getattr(getattr(worker.step_model, "cost_model", None), "metadata", {})
            speeds = (metadata.get("host_sharing") or {}).get("speed")
            if speeds:
                if any(not 0 < v <= 1.5 for v in speeds):
                    raise ValueError(f"host_sharing speeds out of range: {speeds}")
                return [float(v) for v in speeds]
        raise ValueError("host.sharing: measured needs a profile measured with "
                         "`deepinfer profile --host-sharing N`")

    def _time_sharing(self) -> TimeSharing | None:
        spec = self.cluster.host_time_sharing
        if spec != "measured":
            return spec
        for worker in self.workers.values():
            metadata = getattr(getattr(worker.step_model, "cost_model", None), "metadata", {})
            data = metadata.get("time_sharing")
            if data:
                return time_sharing_from_dict(measured_at_most_one(data),
                                              metadata.get("small_decode_rows"))
        raise ValueError("host.time_sharing: measured needs a profile measured with "
                         "`deepinfer profile --time-sharing`")

    def _memory_contention(self) -> MemoryContention | None:
        spec = self.cluster.host_memory_contention
        if spec != "measured":
            return spec
        for worker in self.workers.values():
            metadata = getattr(getattr(worker.step_model, "cost_model", None), "metadata", {})
            data = metadata.get("memory_contention")
            if data:
                return memory_contention_from_dict(measured_at_most_one(data),
                                                   metadata.get("small_decode_rows"))
        raise ValueError("host.memory_contention: measured needs a profile measured with "
                         "`deepinfer profile --memory-contention`")

    # ---- event loop ------------------------------------------------------------------------
    def _at(self, time_s: float, fn: Callable, *args) -> None:
        heapq.heappush(self._events, (time_s, next(self._seq), fn, args))

    def run(self, requests: list[BenchRequest], max_sim_time_s: float | None = None
            ) -> list[SimRequest]:
        """Simulate `requests` (arrival times from 0) to completion; returns their records in
        input order. `max_sim_time_s` stops early (unfinished requests stay not done)."""
        records = []
        if self.cluster.noise is not None:
            requests = jitter_arrivals(requests, self.cluster.noise.jitter_ms,
                                       self.cluster.noise.seed)
        for i, bench in enumerate(requests):
            record = SimRequest(f"sim-{i}", list(bench.prompt_token_ids), bench.output_len,
                                bench.arrival_time_s)
            self.requests[record.request_id] = record
            records.append(record)
            self._at(bench.arrival_time_s, self._on_arrival, record)
        while self._events:
            time_s, _, fn, args = heapq.heappop(self._events)
            if max_sim_time_s is not None and time_s > max_sim_time_s:
                break
            self.now = time_s
            fn(*args)
        return records

    # ---- front door ------------------------------------------------------------------------
    def _entry_pool(self) -> list[SimWorker]:
        return self.pools["prefill"] if self.cluster.disaggregated else self.pools["colocated"]

    def _on_arrival(self, record: SimRequest) -> None:
        if self.host_load is not None:
            self._host_work(self.host_load.on_arrival())
        pool = self._entry_pool()
        kv = pool[0].scheduler.kv
        record.block_hashes = hash_request_blocks(record.prompt_token_ids, kv.block_size,
                                                  kv.hash_salt)
        if len(pool) == 1:
            worker = pool[0]
        else:
            routing = RoutingRequest(request_id=record.request_id,
                                     num_prompt_tokens=record.prompt_len,
                                     block_hashes=record.block_hashes)
            loads = [w.last_load for w in pool]
            try:
                worker = self.workers[self.prefill_router.route(routing, loads, self.now)]
            except (NoWorkerAvailable, ValueError) as e:
                record.error = str(e)
                return
            plan = self.prefill_router.take_prefix_plan(record.request_id)
            if plan is not None and plan.num_await_blocks and self.store is not None:
                record.prefill_worker = worker.worker_id
                self._await_prefix(worker, record, plan.num_await_blocks, plan.await_until)
                return
        record.prefill_worker = worker.worker_id
        self._deliver(worker, record)

    # ---- awaited prefixes ------------------------------------------------------------------
    def _await_prefix(self, worker: SimWorker, record: SimRequest, num_blocks: int,
                      until: float | None) -> None:
        """Hold the request until its first `num_blocks` blocks are in the store, or `until`."""
        hashes = record.block_hashes[:num_blocks]
        if self._in_store(hashes):
            self._deliver(worker, record)
            return
        self.num_awaited += 1
        self._awaiting[record.request_id] = (worker, record, hashes)
        if until is not None:
            self._at(max(self.now, until), self._release_awaiting, record.request_id)

    def _in_store(self, hashes: list[bytes]) -> bool:
        return all(self.store.contains(h) for h in hashes)

    def _release_awaiting(self, request_id: str) -> None:
        held = self._awaiting.pop(request_id, None)
        if held is not None:
            worker, record, _ = held
            self._deliver(worker, record)

    def _store_put(self, block_hashes: list[bytes]) -> None:
        """A store write landed: release the requests whose awaited prefix is now complete."""
        self.store.put_many(block_hashes)
        for request_id, (_, _, hashes) in list(self._awaiting.items()):
            if self._in_store(hashes):
                self._release_awaiting(request_id)

    def _deliver(self, worker: SimWorker, message) -> None:
        delay = self.cluster.front_latency_ms / 1e3
        self._at(self.now + delay, self._on_input, worker, message)

    def _on_input(self, worker: SimWorker, message) -> None:
        worker.inbox.append(message)
        if not worker.busy:
            self._start_step(worker)

    # ---- worker steps ----------------------------------------------------------------------
    def _handle_inputs(self, worker: SimWorker) -> bool:
        handled = bool(worker.inbox)
        while worker.inbox:
            message = worker.inbox.popleft()
            if isinstance(message, Handoff):
                prompt_len = self.requests[message.request_id].prompt_len
                worker.waiting_alloc.append((message, prompt_len))
            else:
                self._admit_new(worker, message)
        if worker.role == "decode":
            handled = self._allocate_waiting(worker) or handled
        return handled

    def _admit_new(self, worker: SimWorker, record: SimRequest) -> None:
        kv = worker.scheduler.kv
        if self.store is not None and worker.role == "prefill" and kv.enable_prefix_caching:
            usable = record.block_hashes[:(record.prompt_len - 1) // kv.block_size]
            load = kv.load_prefix_blocks(usable, self.store.get, lambda block_id, payload: None)
            if load.num_loaded_blocks:
                record.num_store_tokens = load.num_loaded_blocks * kv.block_size
                num_bytes = record.num_store_tokens * worker.step_model.kv_bytes_per_token
                worker.stall_s += self.cluster.prefix_store.link.seconds(num_bytes)
        self._add_request(worker, record)

    def _add_request(self, worker: SimWorker, record: SimRequest) -> None:
        """Queue the prompt in the worker's scheduler (after any store loads)."""
        params = SamplingParams(temperature=0.0, max_tokens=record.output_len, ignore_eos=True)
        request = Request(record.request_id, record.prompt_token_ids, params, record.arrival_s)
        request.block_hashes = list(record.block_hashes)
        try:
            worker.scheduler.add_request(request)
        except ValueError as e:
            record.error = str(e)

    def _start_step(self, worker: SimWorker) -> None:
        if self._handle_inputs(worker):
            self._publish(worker)
        if not worker.has_work():
            worker.busy = False
            return
        output = worker.scheduler.schedule(self.now)
        if output.is_empty:
            # Nothing fits now (e.g. blocks held by transfers); a later event wakes the worker.
            self._apply(worker, output, StepResult({}))
            worker.busy = False
            return
        chunks = [ChunkShape(s.num_computed_tokens, s.num_new_tokens) for s in output.scheduled]
        work_s = worker.step_model.step_time_s(chunks)
        noise = self._step_noise.get(worker.worker_id)
        if noise is not None:
            work_s *= noise.factor()
        work_s += worker.stall_s
        worker.stall_s = 0.0
        worker.busy, worker.output = True, output
        worker.step_started_s, worker.work_left_s = self.now, work_s
        worker.work_time_s += work_s
        if self.time_sharing is not None:
            self._step_efficiency[worker.worker_id] = self.time_sharing.efficiency(chunks)
        if self.memory_contention is not None:
            self._step_kind[worker.worker_id] = self.memory_contention.kind(chunks)
        worker.peak_kv_usage = max(worker.peak_kv_usage, worker.scheduler.kv.usage)
        self._reshare(worker)

    def _speed(self) -> float:
        """Fraction of full speed each busy worker gets while they share the host's cores."""
        cores = self.cluster.host_cores
        if cores is None:
            return 1.0
        threads = self._busy_threads()
        if not threads:
            return 1.0
        return self._speed_for(threads)

    def _busy_threads(self) -> int:
        threads = sum(w.engine.threads for w in self.workers.values() if w.busy)
        if self.host_load is not None:
            threads += self.host_load.busy_threads()
        return threads

    def _speed_for(self, threads: int) -> float:
        cores = self.cluster.host_cores
        if self._speed_table is not None:
            table = self._speed_table
            if threads <= len(table):
                return table[threads - 1]
            return table[-1] * len(table) / threads
        return min(1.0, cores / threads)

    def _reshare(self, changed: SimWorker) -> None:
        """A worker started or finished a step: bring every busy worker's remaining work up to
        now at the old speed, then (re)schedule its finish at the new speed."""
        speed = self._speed()
        sharing = (self.cluster.host_cores is not None
                   and self.cluster.host_sharing in ("fair", "measured"))
        time_shared = (self.time_sharing is not None
                       and self._busy_threads() > self.cluster.host_cores)
        # Memory contention depends on what every other worker runs: re-evaluate them all.
        contention = self.memory_contention
        update_all = sharing or contention is not None
        if contention is not None:
            kinds = {w.worker_id: self._step_kind[w.worker_id]
                     for w in self.workers.values() if w.busy}
        for w in self.workers.values():
            if not w.busy or (w is not changed and not update_all):
                continue
            efficiency_now = self._efficiency_now.get(w.worker_id, 1.0)
            if w is not changed:
                done = min(w.work_left_s, (self.now - w.speed_since_s) * w.speed)
                self.cpu_time_s[w.worker_id] += done / efficiency_now
                w.work_left_s = max(0.0, w.work_left_s - (self.now - w.speed_since_s) * w.speed)
            efficiency = self._step_efficiency.get(w.worker_id, 1.0) if time_shared else 1.0
            w_speed = speed * efficiency if efficiency != 1.0 else speed
            if contention is not None:
                if w is changed or sharing:
                    self._base_speed[w.worker_id] = (w_speed, efficiency)
                else:  # at-start sharing: its speed was fixed when its step started
                    w_speed, efficiency = self._base_speed[w.worker_id]
                factor = contention.efficiency(kinds[w.worker_id], [
                    k for wid, k in kinds.items() if wid != w.worker_id])
                if factor != 1.0:
                    w_speed, efficiency = w_speed * factor, efficiency * factor
            if w is not changed and w.speed == w_speed and efficiency == efficiency_now:
                continue  # same speed: its scheduled finish still holds
            self._efficiency_now[w.worker_id] = efficiency
            w.speed, w.speed_since_s = w_speed, self.now
            w.step_version += 1
            self._at(self.now + w.work_left_s / w_speed, self._finish_step, w, w.step_version)
        if self.host_load is not None:
            self._reshare_jobs(speed, changed)
        if update_all:  # progress of the others is accounted up to now
            for w in self.workers.values():
                if w.busy:
                    w.speed_since_s = self.now

    def _finish_step(self, worker: SimWorker, version: int) -> None:
        if version != worker.step_version or not worker.busy:
            return  # superseded: the worker's speed changed after this was scheduled
        output = worker.output
        # The last stretch at the current speed did the rest of the step's work.
        self.cpu_time_s[worker.worker_id] += (
            worker.work_left_s / self._efficiency_now.get(worker.worker_id, 1.0))
        worker.work_left_s = 0.0
        worker.step_time_s = self.now - worker.step_started_s
        if worker.compute_rate is not None:  # the engine's prefill worker measures this step
            worker.compute_rate.observe(sum(s.num_new_tokens for s in output.scheduled),
                                        worker.step_time_s)
        sampled = {s.request_id: SAMPLED_TOKEN_ID for s in output.scheduled if s.sample}
        self._apply(worker, output, StepResult(sampled, step_time_s=worker.step_time_s))
        worker.busy_time_s += worker.step_time_s
        worker.num_steps += 1
        worker.busy, worker.output = False, None
        self._reshare(worker)
        self._publish(worker)
        self._start_step(worker)

    def _apply(self, worker: SimWorker, output, result: StepResult) -> None:
        sched = worker.scheduler
        update = sched.update(output, result)
        if self.host_load is not None:
            self._host_work(self.host_load.on_tokens(len(update.new_token_ids)))
        if self.check:
            worker.check_invariants()
        for request_id in update.new_token_ids:
            record = self.requests[request_id]
            record.token_times_s.append(self.now)
            if record.num_cached_tokens is None:
                request = sched.requests.get(request_id)
                cached = request.num_cached_tokens if request is not None else None
                if cached is None:
                    cached = next((r.num_cached_tokens for r in update.finished
                                   if r.request_id == request_id), 0)
                record.num_cached_tokens = cached or 0
                record.num_store_tokens = min(record.num_store_tokens, record.num_cached_tokens)
        for request in update.finished:
            record = self.requests[request.request_id]
            if request.status == RequestStatus.FINISHED_LENGTH and \
                    request.num_output_tokens < record.output_len:
                record.error = "prompt does not fit the KV cache"
            record.finished_s = self.now
            if worker.role == "prefill":  # finished by its first token: prompt published
                self.prefill_router.on_prefill_done(request.request_id)
        if worker.role == "prefill":
            for request_id in update.new_token_ids:
                if request_id in sched.requests:  # not finished by its first token
                    self._hand_off(worker, request_id)

    # ---- disaggregation --------------------------------------------------------------------
    def _hand_off(self, worker: SimWorker, request_id: str) -> None:
        record = self.requests[request_id]
        record.handoff_s = self.now
        worker.scheduler.finish_requests([request_id], RequestStatus.FINISHED_ABORTED)
        self.prefill_router.on_prefill_done(request_id)  # its blocks are published
        if self.host_load is not None:
            self._host_work(self.host_load.on_handoff())
        if self.store is not None:
            num_bytes = record.prompt_len * worker.step_model.kv_bytes_per_token
            self._at(self.now + self.cluster.prefix_store.link.seconds(num_bytes),
                     self._store_put, list(record.block_hashes))
            # The worker's own CPU for publishing the blocks it computed (copy out, encode,
            # checksum and write; measured by `deepinfer profile`): blocks it found cached
            # were published or read before and are not written again.
            bs = worker.scheduler.kv.block_size
            num_blocks = max(0, record.prompt_len // bs - (record.num_cached_tokens or 0) // bs)
            step_model = worker.step_model
            worker.stall_s += (num_blocks * bs * step_model.kv_bytes_per_token
                               * step_model.publish_s_per_byte)
        if self.host_load is not None:  # its handoff path's own CPU, as calibrated
            worker.stall_s += self.host_load.spec.prefill_per_handoff_s
        routing = RoutingRequest(request_id=request_id, num_prompt_tokens=record.prompt_len,
                                 expected_output_tokens=record.output_len)
        loads = [w.last_load for w in self.pools["decode"]]
        try:
            target = self.workers[self.decode_router.route(routing, loads, self.now)]
        except (NoWorkerAvailable, ValueError) as e:
            record.error = f"no decode worker: {e}"
            return
        record.decode_worker = target.worker_id
        self._deliver(target, Handoff(request_id, SAMPLED_TOKEN_ID))

    def _allocate_waiting(self, worker: SimWorker) -> bool:
        """FIFO: allocate blocks for prompts whose KV will arrive; start their transfers."""
        started = False
        while worker.waiting_alloc:
            handoff, prompt_len = worker.waiting_alloc[0]
            record = self.requests[handoff.request_id]
            params = SamplingParams(temperature=0.0, max_tokens=record.output_len,
                                    ignore_eos=True)
            request = Request(record.request_id, record.prompt_token_ids, params,
                              record.arrival_s)
            request.block_hashes = list(record.block_hashes)
            request.append_output_token(handoff.first_token_id)
            try:
                block_ids = worker.scheduler.allocate_for_transfer(request)
            except ValueError as e:
                worker.waiting_alloc.popleft()
                record.error = str(e)
                continue
            if block_ids is None:
                break  # wait for blocks to free up
            worker.waiting_alloc.popleft()
            worker.transferring[handoff.request_id] = prompt_len
            self._start_transfer(worker, handoff.request_id, prompt_len)
            started = True
        return started

    def _start_transfer(self, worker: SimWorker, request_id: str, prompt_len: int) -> None:
        link = self.cluster.kv_transfer
        num_bytes = prompt_len * worker.step_model.kv_bytes_per_token
        start = max(self.now, self._link_free_at.get(worker.worker_id, 0.0))
        self.requests[request_id].transfer_start_s = self.now
        wire_s = num_bytes / (link.bandwidth_gb_s * 1e9)
        self._link_free_at[worker.worker_id] = start + wire_s
        self.num_transfers += 1
        self.transfer_bytes += num_bytes
        floor_s = start + wire_s + link.latency_ms / 1e3
        if self.host_load is not None and self.host_load.spec.charges_transfers:
            self._transfer_with_cpu(worker, request_id, num_bytes, floor_s)
            return
        self._at(floor_s, self._on_transfer_done, worker, request_id)

    def _on_transfer_done(self, worker: SimWorker, request_id: str) -> None:
        worker.transferring.pop(request_id)
        worker.scheduler.admit_transferred(request_id)
        self.requests[request_id].admitted_s = self.now
        if not worker.busy:
            self._start_step(worker)

    # ---- other CPU on the host (sim.host_load) ---------------------------------------------
    def _host_work(self, items: list[tuple[str, float]]) -> None:
        """Queue background CPU work, as an event at `now`: called from inside a step's
        completion, it must not reshare while that step is being finished."""
        for name, work_s in items:
            self._at(self.now, self._add_job_work, self.host_load.job(name), work_s, None)

    def _add_job_work(self, job: CpuJob, work_s: float, on_done: Callable | None) -> None:
        if job.add(work_s, on_done):  # a new busy thread: every speed changes
            job.speed_since_s = self.now  # it did no work while idle
            self._reshare(job)

    def _reshare_jobs(self, speed: float, changed) -> None:
        """`_reshare` for the background jobs: always processor sharing (under `at-start` too;
        a job is many short pieces of work, not a step whose speed is fixed at its start)."""
        for job in self.host_load.jobs.values():
            if not job.busy:
                continue
            job.advance(self.now)
            if job is not changed and job.speed == speed:
                continue  # same speed: its scheduled finish still holds
            job.speed = speed
            job.version += 1
            self._at(self.now + job.head_left_s() / speed, self._finish_job, job, job.version)

    def _finish_job(self, job: CpuJob, version: int) -> None:
        if version != job.version or not job.busy:
            return  # superseded: its speed changed after this was scheduled
        job.advance(self.now)
        _, on_done = job.items.popleft()
        self._reshare(job)  # its next item, or one busy thread fewer
        if on_done is not None:
            on_done()

    def _transfer_with_cpu(self, worker: SimWorker, request_id: str, num_bytes: float,
                           floor_s: float) -> None:
        """A KV transfer that costs CPU at both ends: it lands once the link's floor has
        passed and the sender's and receiver's transport threads have done their work."""
        send_s, recv_s = self.host_load.transfer_work(num_bytes)
        source = self.requests[request_id].prefill_worker
        parts = [("link", None)] + [(name, w) for name, w in (
            (f"kv-send:{source}", send_s), (f"kv-recv:{worker.worker_id}", recv_s)) if w > 0]
        left = [len(parts)]

        def part_done() -> None:
            left[0] -= 1
            if not left[0]:
                self._on_transfer_done(worker, request_id)
        self._at(floor_s, part_done)
        for name, work_s in parts[1:]:
            self._add_job_work(self.host_load.job(name), work_s, part_done)

    # ---- load reports ----------------------------------------------------------------------
    def _publish(self, worker: SimWorker) -> None:
        worker.last_load = worker.load(self.now)
        router = self.decode_router if worker.role == "decode" else self.prefill_router
        router.on_load_report(worker.last_load)
