"""`KVPrefetcher`: reads a prompt's stored blocks on a background thread while it queues.

    submit(job) ──▶ [thread] for each hash in order: fetch ─hit─▶ payloads[...]
                                                       └─miss─▶ stop, or (await) poll until
                                                                the block appears or deadline
    poll()      ◀── finished jobs (the engine loop takes them between steps)

The engine loop never waits on the store: it admits a request once its job is done. A job
ends at its first miss (the rest of the prompt is computed), at its deadline (what arrived
is used; set by the caller to what recomputing would cost), or, for the first
`num_await_blocks`, after waiting for blocks another worker is computing and publishing
now. Read times are measured for the store's rate estimate. A caller need not wait for a
job stuck in one slow read past its deadline: `leading()` is what has arrived so far, and
`reading_since` says how long the read in progress has taken (a lower bound on the store's
cost per block).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)
AWAIT_POLL_S = 0.005  # between looks for an awaited block (background thread only)


@dataclass
class PrefetchJob:
    request_id: str
    block_hashes: list[bytes]
    deadline: float  # time.monotonic()
    num_await_blocks: int = 0  # leading hashes worth waiting for (published soon elsewhere)
    payloads: list[bytes] = field(default_factory=list)  # leading hits, in order
    tiers: list[str] = field(default_factory=list)  # which tier answered each
    num_bytes: int = 0
    read_s: float = 0.0  # time spent in store reads (waits excluded)
    waited_s: float = 0.0
    reading_since: float | None = None  # a store read is in progress since (monotonic)
    cancelled: bool = False
    done: bool = False

    def leading(self) -> tuple[list[bytes], list[str]]:
        """(payloads, tiers) read so far; safe while the thread still appends."""
        n = min(len(self.payloads), len(self.tiers))
        return self.payloads[:n], self.tiers[:n]


class KVPrefetcher:
    def __init__(self, fetch: Callable[[bytes], tuple[bytes | None, str | None]],
                 contains: Callable[[bytes], bool], num_threads: int = 4) -> None:
        if num_threads < 1:
            raise ValueError("num_threads must be >= 1")
        self._fetch = fetch
        self._contains = contains
        self.num_threads = num_threads  # a job awaiting a block does not hold up the others
        self._cond = threading.Condition()
        self._queue: deque[PrefetchJob] = deque()
        self._running: list[PrefetchJob] = []
        self._done: list[PrefetchJob] = []
        self._closed = False
        self._threads: list[threading.Thread] = []

    def submit(self, job: PrefetchJob) -> None:
        with self._cond:
            if self._closed:
                job.done = True
                self._done.append(job)
                return
            self._queue.append(job)
            if len(self._threads) < self.num_threads:
                thread = threading.Thread(target=self._run, name="kv-prefetch", daemon=True)
                self._threads.append(thread)
                thread.start()
            self._cond.notify_all()

    def cancel(self, request_id: str) -> None:
        with self._cond:
            for job in (*self._queue, *self._running):
                if job.request_id == request_id:
                    job.cancelled = True

    def poll(self) -> list[PrefetchJob]:
        """Jobs finished since the last call (cancelled ones included, marked)."""
        with self._cond:
            done, self._done = self._done, []
        return done

    def close(self, timeout_s: float = 2.0) -> None:
        with self._cond:
            self._closed = True
            for job in (*self._queue, *self._running):
                job.cancelled = True
            self._cond.notify_all()
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                job = self._queue.popleft()
                self._running.append(job)
            try:
                if not job.cancelled:
                    self._read(job)
            except Exception:  # the stores absorb backend errors; this is a bug: recompute
                logger.exception("kv prefetch of %s failed", job.request_id)
            finally:
                with self._cond:
                    self._running.remove(job)
                    job.done = True
                    self._done.append(job)

    def _read(self, job: PrefetchJob) -> None:
        for i, block_hash in enumerate(job.block_hashes):
            if job.cancelled or time.monotonic() > job.deadline:
                return
            payload, tier = self._timed_fetch(job, block_hash)
            if payload is None and i < job.num_await_blocks:
                payload, tier = self._await(job, block_hash)
            if payload is None:
                return
            job.payloads.append(payload)
            job.tiers.append(tier)
            job.num_bytes += len(payload)

    def _timed_fetch(self, job: PrefetchJob, block_hash: bytes):
        job.reading_since = start = time.monotonic()
        try:
            return self._fetch(block_hash)
        finally:
            job.read_s += time.monotonic() - start
            job.reading_since = None

    def _await(self, job: PrefetchJob, block_hash: bytes) -> tuple[bytes | None, str | None]:
        """Poll for a block another worker is publishing, until the job's deadline."""
        start = time.monotonic()
        try:
            while not job.cancelled and time.monotonic() < job.deadline:
                if self._contains(block_hash):
                    payload, tier = self._timed_fetch(job, block_hash)
                    if payload is not None:
                        return payload, tier
                time.sleep(AWAIT_POLL_S)
            return None, None
        finally:
            job.waited_s += time.monotonic() - start
