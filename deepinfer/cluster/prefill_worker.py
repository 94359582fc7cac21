"""`PrefillWorkerLoop`: computes prompts, streams the first token, stages the KV for decode.

Per request: the shared store tier loads the prompt's stored blocks into the device cache
(`SharedPrefixTier.load_prefix`), the engine prefills (device prefix cache first) and samples
the first token. If that token finishes the request (EOS, stop, max_tokens=1) the final delta
goes to the front and nothing moves. Otherwise the request's blocks are copied to host
memory and staged on the `KVTransport`, the request leaves this engine (its device blocks are
freed at once and stay in the prefix cache), its new full blocks are written through to the
store, and the front receives the first token plus a `PrefillDone` handoff.

Staged host memory is capped (`StagingBudget`, `spec.max_staged_bytes`): a prompt enters the
engine only when its KV will fit next to what is staged and promised; until then it waits
here in FIFO order, counted as waiting load, and the load report says the staging is full.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from deepinfer.cluster.kv_transport import KVTransport
from deepinfer.cluster.messages import AbortRequests, PrefillDone, PrefillRequest
from deepinfer.cluster.prefix_store_tier import SharedPrefixTier
from deepinfer.cluster.staging_budget import StagingBudget
from deepinfer.cluster.worker_loop import WorkerLoop

logger = logging.getLogger(__name__)


@dataclass
class _Prefilling:
    prompt_token_ids: list[int]
    num_store_tokens: int  # loaded into the device cache from the shared store


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
        self._held: deque[PrefillRequest] = deque()  # waiting for staging room (FIFO)

    def handle(self, message) -> None:
        if isinstance(message, AbortRequests):
            aborted = set(message.request_ids)
            self._held = deque(m for m in self._held if m.request_id not in aborted)
            for request_id in message.request_ids:
                self._prefilling.pop(request_id, None)
                self.staging.release(request_id)
                self.transport.unstage(request_id)
            return
        if not isinstance(message, PrefillRequest):
            logger.warning("prefill worker ignores %s", type(message).__name__)
            return
        if message.sampling_params.n != 1:
            self.emit_error(message.request_id, "disaggregated serving supports n=1 only")
            return
        self._held.append(message)
        self._admit_held()

    def before_step(self) -> None:
        self._admit_held()

    def has_background_work(self) -> bool:
        return bool(self._held)  # staging frees up as decode workers pull

    def _admit_held(self) -> None:
        staged = self.transport.stats().staged_bytes
        while self._held:
            message = self._held[0]
            need = self.staging.need(len(message.prompt_token_ids))
            if not self.staging.can_admit(need, staged):
                return
            self._held.popleft()
            if self._admit(message):
                self.staging.promise(message.request_id, need)

    def _admit(self, message: PrefillRequest) -> bool:
        num_store_tokens = 0
        if self.tier is not None:
            load = self.tier.load_prefix(message.prompt_token_ids)
            num_store_tokens = load.num_store_blocks * self.engine.config.block_size
        try:
            self.engine.add_request(message.request_id, message.prompt_token_ids,
                                    message.sampling_params, arrival_time=message.arrival_time)
        except ValueError as exc:
            self.emit_error(message.request_id, str(exc))
            return False
        self.tracker.add_request(message.request_id, message.sampling_params)
        self._prefilling[message.request_id] = _Prefilling(list(message.prompt_token_ids),
                                                           num_store_tokens)
        return True

    def after_step(self, outputs: list) -> None:
        for output in outputs:
            entry = self._prefilling.pop(output.request_id, None)
            if entry is None:
                continue
            self._count_prefix_hits(entry, output.num_cached_tokens or 0)
            delta = self.tracker.to_delta(output)
            self._outputs.append(delta)
            if not output.finished:
                self._hand_off(output, delta, entry)  # staged: counted as staged bytes now
            self.staging.release(output.request_id)

    def _count_prefix_hits(self, entry: _Prefilling, num_cached: int) -> None:
        c = self.counters
        store_hit = min(entry.num_store_tokens, num_cached)
        c.prefix_query_tokens += len(entry.prompt_token_ids)
        c.store_hit_tokens += store_hit
        c.device_hit_tokens += num_cached - store_hit

    def _hand_off(self, output, delta, entry: _Prefilling) -> None:
        request_id = output.request_id
        block_ids = self.engine.scheduler.kv.block_ids(request_id)
        kv = self.engine.cache.read_blocks(block_ids)  # [L, 2, H, blocks, bs, D] copy
        self.engine.abort_request([request_id])  # frees the device blocks (they stay cached)
        self.tracker.forget([request_id])
        num_bytes = self.transport.stage(request_id, kv, self.spec.kv_stage_ttl_s)
        if self.tier is not None:
            self.tier.write_through(entry.prompt_token_ids, kv)
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
        # Prompts held back count as well: the worker is full while any wait for room.
        used = self.staging.used_bytes(staged)
        if self._held:
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
