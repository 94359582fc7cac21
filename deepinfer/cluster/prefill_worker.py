"""`PrefillWorkerLoop`: computes prompts, streams the first token, stages the KV for decode.

Per request: while it queues, a prefetch thread (`KVPrefetcher`) reads the prompt's blocks
after its device-cached head from the shared store (and waits for blocks the router said
another worker is computing now); the engine loop never reads the store. Once read, the
blocks are written into the device cache (`SharedPrefixTier.load_fetched`), the engine
prefills (device prefix cache first) and samples the first token. Each full block is
published to the store as soon as its chunk is computed, so other workers can read it before
this prompt finishes. If the first token finishes the request (EOS, stop, max_tokens=1) the
final delta goes to the front and nothing moves. Otherwise the request's blocks are copied to
host memory and staged on the `KVTransport`, the request leaves this engine (its device
blocks are freed at once and stay in the prefix cache), its remaining full blocks are written
through to the store, and the front receives the first token plus a `PrefillDone` handoff.

Load or recompute: store reads and prefill compute are both measured (`RateEstimator`); a
prefix is read only when `plan_store_load` predicts that loading beats recomputing, and a
read (or wait) is cut off at twice the predicted recompute time (plus 20 ms), so a slow store
can cost a prefill at most about that much over having no store. The cut-off holds even when
one read hangs: at its deadline the request is admitted with the blocks read so far (the
rest is recomputed), and the hung read's age raises the store estimate at once, so the next
prompts recompute instead of paying the deadline again. While the estimate says "slow", every
`STORE_PROBE_EVERY`-th prompt still reads (within the same budget), to notice recovery.

Staged host memory is capped (`StagingBudget`, `spec.max_staged_bytes`): a prompt enters the
engine only when its KV will fit next to what is staged and promised; until then it waits
here in FIFO order, counted as waiting load, and the load report says the staging is full.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from deepinfer.cluster.kv_transport import KVTransport
from deepinfer.wire.worker_messages import AbortRequests, PrefillDone, PrefillRequest
from deepinfer.cluster.prefill_images import (attach_embedding_store, image_spans,
                                              missing_embeddings)
from deepinfer.cluster.prefix_store_tier import SharedPrefixTier
from deepinfer.cluster.staging_budget import StagingBudget
from deepinfer.cluster.worker_loop import WorkerLoop
from deepinfer.core.cost_model import RateEstimator, plan_store_load, prefill_compute_rate
from deepinfer.kvstore.prefetcher import KVPrefetcher, PrefetchJob
from deepinfer.kvstore.tiered_store import HOST_TIER, fetch_with_tier

logger = logging.getLogger(__name__)

# Priors until measured: shared-store reads, seconds per token (compute: prefill_compute_rate).
STORE_PRIOR_S_PER_TOKEN = 2e-5
STORE_READ_LATENCY_S = 1e-3
READ_BUDGET_SLACK_S = 0.02
STORE_PROBE_EVERY = 16  # skipped prompts per probe read while loading looks dearer


@dataclass
class _Prefilling:
    prompt_token_ids: list[int]
    num_store_tokens: int  # loaded into the device cache from the shared store
    num_host_tokens: int = 0  # of which from the host-memory tier
    block_hashes: list[bytes] = field(default_factory=list)  # full blocks (publishing)
    num_published_blocks: int = 0


class PrefillWorkerLoop(WorkerLoop):
    role = "prefill"

    def __init__(self, spec, engine, input_socket, output_socket, transport: KVTransport,
                 tier: SharedPrefixTier | None) -> None:
        super().__init__(spec, engine, input_socket, output_socket)
        self.transport = transport
        self.tier = tier
        self._prefilling: dict[str, _Prefilling] = {}
        self.staging = StagingBudget(spec.max_staged_bytes, engine.cache.spec.bytes_per_block,
                                     engine.config.block_size)
        self._held: deque[PrefillRequest] = deque()  # for store reads or staging room (FIFO)
        self._waiting_for_room = False  # a held prompt whose reads are done does not fit
        self._jobs: dict[str, PrefetchJob] = {}  # store reads of held requests
        self.prefetcher = (KVPrefetcher(lambda h: fetch_with_tier(tier.store, h),
                                        tier.store.contains) if tier is not None else None)
        self.compute_rate = prefill_compute_rate()
        self.store_rate = RateEstimator(STORE_PRIOR_S_PER_TOKEN, STORE_READ_LATENCY_S,
                                        typical_units=256)
        self._step_start: tuple[float, int] | None = None
        attach_embedding_store(engine, spec.kv_store_url)  # E/P/D: embeddings by image hash
        self._num_skipped_since_read = 0
        self._num_failed_steps = 0

    def forget_failed(self, request_id: str) -> None:
        self._prefilling.pop(request_id, None)  # never published past what it computed
        self.staging.release(request_id)
        self.transport.unstage(request_id)

    def handle(self, message) -> None:
        if isinstance(message, AbortRequests):
            aborted = set(message.request_ids)
            self._held = deque(m for m in self._held if m.request_id not in aborted)
            for request_id in message.request_ids:
                self._prefilling.pop(request_id, None)
                self.staging.release(request_id)
                self.transport.unstage(request_id)
                if self._jobs.pop(request_id, None) is not None:
                    self.prefetcher.cancel(request_id)
            return
        if not isinstance(message, PrefillRequest):
            logger.warning("prefill worker ignores %s", type(message).__name__)
            return
        if message.sampling_params.n != 1:
            self.emit_error(message.request_id, "disaggregated serving supports n=1 only")
            return
        self._held.append(message)
        self._start_prefetch(message)
        self._admit_held()

    def before_step(self) -> None:
        self._admit_held()
        self._step_start = (time.monotonic(), self._num_computed())

    def has_background_work(self) -> bool:
        return bool(self._held)  # staging frees up as decode workers pull; reads finish

    # --- store reads, off the engine loop -----------------------------------------------------
    def _usable_hashes(self, message: PrefillRequest) -> list[bytes]:
        return self.tier.usable_hashes(message.prompt_token_ids, image_spans(message),
                                       message.sampling_params.cache_salt)

    def _start_prefetch(self, message: PrefillRequest) -> None:
        """Read the prompt's stored blocks (after its device-cached head) while it queues,
        if loading is predicted to beat recomputing them."""
        if self.tier is None:
            return
        bs = self.engine.config.block_size
        hashes = self._usable_hashes(message)
        num_device = self.tier.num_device_blocks(hashes)
        wanted = hashes[num_device:]
        if not wanted:
            return
        prompt_len = len(message.prompt_token_ids)
        plan = plan_store_load(prompt_len, num_device * bs, len(wanted), bs,
                               lambda k: self.store_rate.seconds(k * bs),
                               lambda new, ctx: self.compute_rate.seconds(new))
        num_await = max(0, min(message.num_await_blocks, len(hashes)) - num_device)
        num_read = max(plan.num_load_blocks, num_await)
        if num_read == 0 and self._num_skipped_since_read + 1 >= STORE_PROBE_EVERY:
            num_read = len(wanted)  # a probe: has the store become fast again?
        if num_read == 0:
            self._num_skipped_since_read += 1
            self.counters.store_loads_skipped += 1
            return
        self._num_skipped_since_read = 0
        now = time.monotonic()
        # Reading (or waiting) much longer than recomputing would take only makes TTFT
        # worse; twice the estimate (plus a little) leaves room for its noise.
        budget_s = 2.0 * self.compute_rate.seconds(num_read * bs) + READ_BUDGET_SLACK_S
        if num_await:
            budget_s = max(budget_s, message.await_timeout_s)
        job = PrefetchJob(message.request_id, wanted[:num_read], now + budget_s,
                          num_await_blocks=num_await)
        self._jobs[message.request_id] = job
        self.prefetcher.submit(job)

    def _prefetch_ready(self, request_id: str) -> bool:
        """Its reads are done, or past their deadline (a hung read is not waited for)."""
        job = self._jobs.get(request_id)
        return job is None or job.done or time.monotonic() >= job.deadline

    def _collect_prefetches(self) -> None:
        if self.prefetcher is None:
            return
        bs = self.engine.config.block_size
        for job in self.prefetcher.poll():
            if job.payloads and not job.cancelled:
                self.store_rate.observe(len(job.payloads) * bs, job.read_s)

    def _admit_held(self) -> None:
        """Admit held prompts whose store reads are done, in order, while staging has room."""
        self._collect_prefetches()
        staged = self.transport.stats().staged_bytes
        still: deque[PrefillRequest] = deque()
        full = False
        for message in self._held:
            if full or not self._prefetch_ready(message.request_id):
                still.append(message)
                continue
            need = self.staging.need(len(message.prompt_token_ids))
            if not self.staging.can_admit(need, staged):
                full = True  # FIFO for staging room: later prompts must not overtake it
                still.append(message)
                continue
            if self._admit(message):
                self.staging.promise(message.request_id, need)
        self._held = still
        self._waiting_for_room = full

    def _load_prefetched(self, message: PrefillRequest) -> tuple[int, int]:
        """Write the prefetched blocks into the device cache: (store tokens, host tokens)."""
        job = self._jobs.pop(message.request_id, None)
        if job is None:
            return 0, 0
        bs = self.engine.config.block_size
        if not job.done:
            self._give_up_read(job)
        payloads, tiers = job.leading()
        if not payloads:
            return 0, 0
        fetched = dict(zip(job.block_hashes, payloads))
        load = self.tier.load_fetched(self._usable_hashes(message), fetched)
        tiers = dict(zip(job.block_hashes, tiers))
        hashes = self._usable_hashes(message)
        loaded = hashes[load.num_device_blocks:load.num_device_blocks + load.num_store_blocks]
        num_host = sum(1 for h in loaded if tiers.get(h) == HOST_TIER)
        if job.num_await_blocks and job.waited_s > 0:  # not when they were there already
            self.counters.store_await_tokens += min(len(payloads), job.num_await_blocks) * bs
        return load.num_store_blocks * bs, num_host * bs

    def _give_up_read(self, job: PrefetchJob) -> None:
        """The job's deadline passed mid-read: the rest of the prompt is recomputed. A read
        still running after t seconds proves the store costs at least t per block; the moving
        average would need many more prompts (each paying the whole budget) to learn that."""
        self.prefetcher.cancel(job.request_id)
        self.counters.store_read_timeouts += 1
        since = job.reading_since
        if since is not None:
            s_per_token = (time.monotonic() - since) / self.engine.config.block_size
            if s_per_token > self.store_rate.s_per_unit:
                self.store_rate.s_per_unit = s_per_token
                self.store_rate.num_samples += 1

    def _admit(self, message: PrefillRequest) -> bool:
        missing = missing_embeddings(self.engine, message)
        if missing:
            self.emit_error(message.request_id, missing)
            return False
        num_store_tokens = num_host_tokens = 0
        if self.tier is not None:
            num_store_tokens, num_host_tokens = self._load_prefetched(message)
        try:
            mm = {"mm_inputs": message.mm_inputs} if message.mm_inputs is not None else {}
            self.engine.add_request(message.request_id, message.prompt_token_ids,
                                    message.sampling_params, arrival_time=message.arrival_time,
                                    **mm)
        except ValueError as exc:
            self.emit_error(message.request_id, str(exc), getattr(exc, "param", None))
            return False
        self.tracker.add_request(message.request_id, message.sampling_params)
        hashes = (self.tier.block_hashes(message.prompt_token_ids, image_spans(message),
                                         message.sampling_params.cache_salt)
                  if self.tier is not None else [])
        self._prefilling[message.request_id] = _Prefilling(
            list(message.prompt_token_ids), num_store_tokens, num_host_tokens, hashes)
        return True

    # --- steps --------------------------------------------------------------------------------
    def _num_computed(self) -> dict[str, int]:
        requests = self.engine.scheduler.requests
        return {rid: r.num_computed_tokens for rid in self._prefilling
                if (r := requests.get(rid)) is not None}

    def _tokens_computed_since(self, before: dict[str, int]) -> int:
        """Prompt tokens computed since `before` (prefix-cache hits are not computed)."""
        num = 0
        for rid, after in self._num_computed().items():
            cached = self.engine.scheduler.requests[rid].num_cached_tokens or 0
            num += max(0, after - max(before.get(rid, 0), cached))
        return num

    def after_step(self, outputs: list) -> None:
        # A failed step was undone: its requests computed nothing (their blocks past what
        # earlier steps computed left the prefix cache) and nothing of it is published.
        self.answer_step_failures()
        failed = self.engine.num_failed_steps != self._num_failed_steps
        self._num_failed_steps = self.engine.num_failed_steps
        if self._step_start is not None and not failed:  # a failed step measures nothing
            start, before = self._step_start
            num_computed = self._tokens_computed_since(before)
            self.counters.prefill_computed_tokens += num_computed
            self.compute_rate.observe(num_computed, time.monotonic() - start)
        self._step_start = None
        self._publish_computed_blocks()
        for output in outputs:
            entry = self._prefilling.pop(output.request_id, None)
            if entry is None:
                continue
            self._count_prefix_hits(entry, output.num_cached_tokens or 0)
            delta = self.tracker.to_delta(output)
            self._outputs.append(delta)
            self.counters.num_prefilled_requests += 1
            if not output.finished:
                self._hand_off(output, delta, entry)  # staged: counted as staged bytes now
            self.staging.release(output.request_id)

    def _publish_computed_blocks(self) -> None:
        """Queue each prompt's full blocks computed so far for the shared store."""
        if self.tier is None:
            return
        sched = self.engine.scheduler
        bs = self.engine.config.block_size
        for request_id, entry in self._prefilling.items():
            request = sched.requests.get(request_id)
            if request is None:
                continue
            num_full = min(request.num_computed_tokens // bs, len(entry.block_hashes))
            if num_full <= entry.num_published_blocks:
                continue
            block_ids = sched.kv.block_ids(request_id)[entry.num_published_blocks:num_full]
            kv = self.engine.cache.read_blocks(block_ids)
            self.counters.store_blocks_published += self.tier.publish(
                entry.block_hashes[entry.num_published_blocks:num_full], kv)
            entry.num_published_blocks = num_full

    def _count_prefix_hits(self, entry: _Prefilling, num_cached: int) -> None:
        c = self.counters
        store_hit = min(entry.num_store_tokens, num_cached)
        host_hit = min(entry.num_host_tokens, store_hit)
        c.prefix_query_tokens += len(entry.prompt_token_ids)
        c.store_hit_tokens += store_hit - host_hit
        c.host_hit_tokens += host_hit
        c.device_hit_tokens += num_cached - store_hit

    def store_load_rate(self) -> float | None:
        return self.store_rate.s_per_unit if self.store_rate.num_samples else None

    def compute_load_rate(self) -> float | None:
        return self.compute_rate.s_per_unit if self.compute_rate.num_samples else None

    def _hand_off(self, output, delta, entry: _Prefilling) -> None:
        request_id = output.request_id
        block_ids = self.engine.scheduler.kv.block_ids(request_id)
        kv = self.engine.cache.read_blocks(block_ids)  # [L, 2, H, blocks, bs, D] copy
        self.engine.abort_request([request_id])  # frees the device blocks (they stay cached)
        self.tracker.forget([request_id])
        num_bytes = self.transport.stage(request_id, kv, self.spec.kv_stage_ttl_s)
        if self.tier is not None:
            self.tier.publish(entry.block_hashes[entry.num_published_blocks:],
                              kv.narrow(self.tier.block_axis, entry.num_published_blocks,
                                        kv.shape[self.tier.block_axis]
                                        - entry.num_published_blocks))
        choice = output.outputs[0]
        first_logprob = choice.logprobs[0] if choice.logprobs else None
        self.emit_prefill_done(PrefillDone(
            request_id=request_id, first_token_id=choice.token_ids[0],
            first_logprob=first_logprob, num_text_chars_sent=len(delta.choices[0].text),
            kv_addr=self.transport.address, num_kv_bytes=num_bytes,
            num_cached_tokens=int(output.num_cached_tokens or 0)))

    def extra_load(self) -> tuple[int, int, int]:
        return len(self._held), 0, sum(len(m.prompt_token_ids) for m in self._held)

    def staging_load(self) -> tuple[int, int]:
        staged = self.transport.stats().staged_bytes
        # Prompts held back for room count as well: the worker is full while any wait for
        # it. Prompts held only for their store reads do not: that worker is not full, and
        # reporting it so sent routers elsewhere (cache affinity off its own worker).
        used = self.staging.used_bytes(staged)
        if self._waiting_for_room:
            used = max(used, self.staging.capacity_bytes)
        return used, self.staging.capacity_bytes

    def update_counters(self) -> None:
        c = self.counters
        t = self.transport.stats()
        c.transfer_bytes, c.num_transfers = t.bytes_sent, t.num_sent
        c.num_staged, c.staged_bytes = t.num_staged, t.staged_bytes
        c.num_transfer_failures = t.num_expired
        if self.tier is not None:
            s = self.tier.store.stats()
            c.store_bytes_read, c.store_bytes_written = s.bytes_read, s.bytes_written
            c.store_corrupt_blocks = s.num_corrupt
