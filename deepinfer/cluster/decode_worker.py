"""`DecodeWorkerLoop`: receives prefilled requests' KV and decodes them.

Per `DecodeRequest`: allocate the prompt's blocks (queued FIFO while the cache is full, with a
deadline), then pull the KV from the prefill worker over the `KVTransport` (with a timeout);
when it arrives, write it into the blocks and admit the request as a running decode. A failed
or timed-out transfer, or an abort at any point, frees the blocks and reports an error.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

from deepinfer.cluster.kv_transport import KVTransport
from deepinfer.wire.worker_messages import AbortRequests, DecodeRequest
from deepinfer.cluster.prefill_images import attach_embedding_store
from deepinfer.cluster.worker_loop import WorkerLoop

logger = logging.getLogger(__name__)


@dataclass
class _Incoming:
    message: DecodeRequest
    deadline: float  # allocation + transfer must finish by then
    fetch_after: float = 0.0  # debug delay before the pull starts
    block_ids: list[int] | None = None
    fetching: bool = False
    received_at: float = 0.0  # monotonic times, for the counters
    allocated_at: float = 0.0


class DecodeWorkerLoop(WorkerLoop):
    role = "decode"

    def __init__(self, spec, engine, input_socket, output_socket,
                 transport: KVTransport) -> None:
        super().__init__(spec, engine, input_socket, output_socket)
        self.transport = transport
        self._waiting_alloc: deque[str] = deque()
        self._incoming: dict[str, _Incoming] = {}
        # Counters of where a request's time between tokens goes: when each
        # admitted request was admitted (until its first token here), and when its last
        # token came out of a step; the running / pending counts at the coming step's start.
        self._admitted_at: dict[str, float] = {}
        self._last_token_at: dict[str, float] = {}
        self._step_running = self._step_pending = 0
        self._step_start = 0.0
        # A preempted image request is recomputed here: its embeddings by image hash.
        attach_embedding_store(engine, spec.kv_store_url)

    def handle(self, message) -> None:
        if isinstance(message, AbortRequests):
            for request_id in message.request_ids:
                if self._incoming.pop(request_id, None) is not None:
                    self.transport.cancel_fetch(request_id)
                self._forget_times(request_id)
            return
        if not isinstance(message, DecodeRequest):
            logger.warning("decode worker ignores %s", type(message).__name__)
            return
        now = time.monotonic()
        self._incoming[message.request_id] = _Incoming(
            message, now + self.spec.transfer_timeout_s,
            fetch_after=now + self.spec.debug_transfer_delay_s, received_at=now)
        self._waiting_alloc.append(message.request_id)

    def has_background_work(self) -> bool:
        return bool(self._incoming)

    def has_step_work(self) -> bool:
        return self.engine.has_schedulable_requests()

    def before_step(self) -> None:
        start = time.monotonic()
        self._allocate_waiting()
        self._start_fetches()
        self._finish_transfers()
        self.counters.between_steps_seconds_total += time.monotonic() - start
        self._step_running = self.engine.scheduler.num_running
        self._step_pending = len(self._incoming)
        self._step_start = time.monotonic()

    def after_step(self, outputs: list) -> None:
        first_new = len(self._outputs)
        super().after_step(outputs)
        now = time.monotonic()
        c = self.counters
        c.decode_step_running_requests += self._step_running
        c.decode_step_pending_transfers += self._step_pending
        for delta in self._outputs[first_new:]:
            if not any(choice.token_ids for choice in delta.choices):
                continue
            c.decode_step_token_requests += 1
            c.decode_step_token_seconds_total += now - self._step_start
            request_id = delta.request_id
            admitted = self._admitted_at.pop(request_id, None)
            last = self._last_token_at.get(request_id)
            if admitted is not None:
                c.decode_first_token_wait_seconds_total += now - admitted
            elif last is not None:
                c.decode_token_gap_seconds_total += now - last
                c.decode_token_gaps += 1
            if delta.finished:
                self._last_token_at.pop(request_id, None)
            else:
                self._last_token_at[request_id] = now

    def _forget_times(self, request_id: str) -> None:
        self._admitted_at.pop(request_id, None)
        self._last_token_at.pop(request_id, None)

    def _allocate_waiting(self) -> None:
        now = time.monotonic()
        while self._waiting_alloc:
            request_id = self._waiting_alloc[0]
            entry = self._incoming.get(request_id)
            if entry is None:  # aborted while waiting
                self._waiting_alloc.popleft()
                continue
            if now > entry.deadline:
                self._waiting_alloc.popleft()
                self._fail(request_id, "no KV cache room or sequence slot on the decode "
                                       "worker before the transfer timeout")
                continue
            m = entry.message
            try:
                block_ids = self.engine.add_transferred_request(
                    m.request_id, m.prompt_token_ids, m.sampling_params, m.arrival_time,
                    m.first_token_id, m.first_logprob, m.num_cached_tokens,
                    mm_inputs=m.mm_inputs)
            except ValueError as exc:
                self._waiting_alloc.popleft()
                self._fail(request_id, str(exc), free=False)
                continue
            if block_ids is None:
                return  # FIFO: wait for blocks to free up
            self._waiting_alloc.popleft()
            entry.block_ids = block_ids
            entry.allocated_at = time.monotonic()
            self.counters.decode_alloc_wait_seconds_total += entry.allocated_at - entry.received_at
            self._dirty = True

    def _start_fetches(self) -> None:
        now = time.monotonic()
        for request_id, entry in self._incoming.items():
            if entry.block_ids is not None and not entry.fetching and now >= entry.fetch_after:
                entry.fetching = True
                self.transport.fetch(request_id, entry.message.kv_source_addr,
                                     max(0.05, entry.deadline - now))

    def _finish_transfers(self) -> None:
        for result in self.transport.poll():
            entry = self._incoming.pop(result.request_id, None)
            if entry is None:
                continue  # aborted meanwhile (its blocks are already free)
            if result.error is not None:
                self.counters.num_transfer_failures += 1
                self._fail(result.request_id, result.error)
                continue
            polled_at = time.monotonic()
            try:
                write_received_kv(self.engine.cache, entry.block_ids, result.kv)
            except (RuntimeError, ValueError) as exc:  # e.g. a payload of another layout
                self.counters.num_transfer_failures += 1
                self._fail(result.request_id, f"received KV does not fit this worker's cache: "
                                              f"{exc}")
                continue
            self.engine.admit_transferred(result.request_id)
            admitted_at = time.monotonic()
            self._admitted_at[result.request_id] = admitted_at
            self._kv_received.append(result.request_id)
            m = entry.message
            self.tracker.add_request(m.request_id, m.sampling_params)
            # The first token was streamed by the prefill worker: continue after it.
            self.tracker.resume(m.request_id, num_tokens=1, num_text_chars=m.num_text_chars_sent,
                                num_logprobs=1 if m.first_logprob is not None else 0)
            c = self.counters
            c.transfer_bytes += result.num_bytes
            c.num_transfers += 1
            c.transfer_seconds_total += result.seconds
            c.decode_fetch_wait_seconds_total += polled_at - entry.allocated_at
            c.decode_kv_write_seconds_total += admitted_at - polled_at
            c.decode_admitted += 1
            self._dirty = True

    def forget_failed(self, request_id: str) -> None:
        # An engine fault fails transfers in progress too: their blocks are free now, so a
        # pull still in flight must never be written into them.
        if self._incoming.pop(request_id, None) is not None:
            self.transport.cancel_fetch(request_id)
        self._forget_times(request_id)

    def _fail(self, request_id: str, message: str, free: bool = True) -> None:
        self._incoming.pop(request_id, None)
        self._forget_times(request_id)
        if free:
            self.engine.abort_request([request_id])
        self.emit_error(request_id, message)

    def update_counters(self) -> None:
        s = self.engine.scheduler.spec_stats  # speculation runs on decode workers only
        c = self.counters
        c.spec_decode_num_drafts = s.num_drafts
        c.spec_decode_num_draft_tokens = s.num_draft_tokens
        c.spec_decode_num_accepted_tokens = s.num_accepted_tokens
        c.spec_decode_num_accepted_tokens_per_pos = list(s.num_accepted_tokens_per_pos)

    def extra_load(self) -> tuple[int, int, int]:
        kv_tokens = sum(len(e.message.prompt_token_ids) for e in self._incoming.values())
        return len(self._incoming), kv_tokens, 0


def write_received_kv(cache, block_ids: list[int], kv) -> None:
    """Write a pulled payload (host memory, the sender's dtype) into `block_ids` of `cache`,
    which may live on an accelerator and in another dtype: one copy to its device and dtype."""
    target = cache.kv
    cache.write_blocks(block_ids, kv.to(device=target.device, dtype=target.dtype))
