"""`KVTransport`: moves a request's prompt KV blocks from a prefill worker to a decode worker.

The prefill side *stages* a copy of the request's blocks in host memory (so its device blocks
are freed at once and stay in its prefix cache) and serves it to whoever pulls it; a staged
payload that is not pulled within `ttl_s` is dropped. The decode side allocates its blocks
first, then *fetches* (pulls) the payload with a timeout; results are polled by its engine
loop, which writes them into the allocated blocks.

`ZmqKVTransport` (default) serves pulls on a ROUTER socket over TCP from a background thread
and fetches on another thread with one DEALER per source, every pull in flight at once on one
poller (a slow or dead source holds up only its own pulls, each with its own deadline);
payloads travel as raw frames (no pickling, one copy on each side). Every pull and reply is
signed with the cluster secret and the payload covered by the reply's MAC (kv_frames.py).
"""
from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass

import torch
import zmq

from deepinfer.cluster import kv_frames
from deepinfer.wire.worker_messages import KVPull, KVPullReply

logger = logging.getLogger(__name__)
IDLE_SOURCE_CLOSE_S = 60.0  # a source's DEALER with no pull for this long is closed


@dataclass(frozen=True)
class _Pull:
    addr: str
    deadline: float
    start: float


@dataclass(frozen=True)
class KVFetchResult:
    """A finished fetch: `kv` is `PagedKVCache.read_blocks` output of the staged blocks, or None
    with `error` set."""

    request_id: str
    kv: torch.Tensor | None
    num_bytes: int
    seconds: float
    error: str | None = None


@dataclass(frozen=True)
class KVTransportStats:
    num_staged: int
    staged_bytes: int
    bytes_sent: int
    bytes_received: int
    num_sent: int
    num_received: int
    num_failed: int
    num_expired: int
    receive_seconds_total: float


class KVTransport(ABC):
    """Prefill side: `stage` / `unstage` / `address`. Decode side: `fetch` / `poll`."""

    @property
    @abstractmethod
    def address(self) -> str:
        """Where decode workers pull this worker's staged payloads."""

    @abstractmethod
    def stage(self, request_id: str, kv: torch.Tensor, ttl_s: float) -> int:
        """Keep a CPU copy of `kv` until pulled, unstaged or `ttl_s` passes; returns bytes."""

    @abstractmethod
    def unstage(self, request_id: str) -> None:
        """Drop a staged payload (abort); unknown ids are ignored."""

    @abstractmethod
    def fetch(self, request_id: str, source_addr: str, timeout_s: float) -> None:
        """Start pulling `request_id` from `source_addr`; the result appears in `poll()`."""

    @abstractmethod
    def cancel_fetch(self, request_id: str) -> None:
        """Forget a fetch (its result, if it still arrives, is discarded)."""

    @abstractmethod
    def poll(self) -> list[KVFetchResult]:
        """Fetches finished since the last call (never blocks)."""

    @abstractmethod
    def stats(self) -> KVTransportStats: ...

    @abstractmethod
    def close(self) -> None: ...


class ZmqKVTransport(KVTransport):
    def __init__(self, host: str = "127.0.0.1", serve: bool = True) -> None:
        self._ctx = zmq.Context()
        self._lock = threading.Lock()
        self._staged: dict[str, tuple[torch.Tensor, float]] = {}  # id -> (kv, deadline)
        self._jobs: deque[tuple[str, str, float]] = deque()
        self._num_pending = 0
        self._cancelled: set[str] = set()
        self._results: deque[KVFetchResult] = deque()
        self._closed = False
        self._counts = dict(bytes_sent=0, bytes_received=0, num_sent=0, num_received=0,
                            num_failed=0, num_expired=0, receive_seconds_total=0.0)
        self._address = ""
        self._threads: list[threading.Thread] = []
        if serve:
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            port = router.bind_to_random_port(f"tcp://{host}")
            self._address = f"tcp://{host}:{port}"
            self._start(self._serve_loop, router, "kv-serve")
        # fetch()/cancel_fetch() wake the fetch thread's poller through this inproc pair.
        wake_addr = f"inproc://kv-fetch-wake-{id(self)}"
        wake_pull = self._ctx.socket(zmq.PULL)
        wake_pull.bind(wake_addr)
        self._wake_push = self._ctx.socket(zmq.PUSH)
        self._wake_push.setsockopt(zmq.SNDHWM, 1)
        self._wake_push.setsockopt(zmq.LINGER, 0)
        self._wake_push.connect(wake_addr)
        self._start(self._fetch_loop, wake_pull, "kv-fetch")

    def _start(self, target, arg, name: str) -> None:
        thread = threading.Thread(target=target, args=(arg,) if arg is not None else (),
                                  name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    @property
    def address(self) -> str:
        return self._address

    # --- prefill side ------------------------------------------------------------------------
    def stage(self, request_id: str, kv: torch.Tensor, ttl_s: float) -> int:
        kv = kv.detach().to("cpu").contiguous()
        with self._lock:
            self._staged[request_id] = (kv, time.monotonic() + ttl_s)
        return kv.numel() * kv.element_size()

    def unstage(self, request_id: str) -> None:
        with self._lock:
            self._staged.pop(request_id, None)

    def _serve_loop(self, router: zmq.Socket) -> None:
        encoder = kv_frames.reply_sender(self._address)
        decoder = kv_frames.pull_receiver(self._address)
        while not self._closed:
            self._expire()
            if not router.poll(100):
                continue
            read = kv_frames.read_pull(decoder, router.recv_multipart())  # None: dropped
            if read is None:
                continue
            identity, pull = read
            with self._lock:
                staged = self._staged.pop(pull.request_id, None)
            if staged is None:
                reply = KVPullReply(pull.request_id, ok=False, message="not staged (expired, "
                                    "aborted or unknown)")
                router.send_multipart([identity, encoder.encode(reply)])
                continue
            kv = staged[0]
            reply = KVPullReply(pull.request_id, ok=True, shape=list(kv.shape),
                                dtype=str(kv.dtype).removeprefix("torch."))
            raw = kv.view(-1).view(torch.uint8).numpy()  # [bytes], zero-copy
            router.send_multipart([identity, encoder.encode(reply, [raw]), raw], copy=False)
            with self._lock:
                self._counts["bytes_sent"] += raw.nbytes
                self._counts["num_sent"] += 1
        router.close(linger=0)

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            for request_id in [r for r, (_, d) in self._staged.items() if d < now]:
                del self._staged[request_id]
                self._counts["num_expired"] += 1
                logger.warning("kv transport: staged KV of %s expired unpulled", request_id)

    # --- decode side -------------------------------------------------------------------------
    def fetch(self, request_id: str, source_addr: str, timeout_s: float) -> None:
        with self._lock:
            self._cancelled.discard(request_id)
            self._jobs.append((request_id, source_addr, time.monotonic() + timeout_s))
        self._wake()

    def cancel_fetch(self, request_id: str) -> None:
        with self._lock:
            self._cancelled.add(request_id)
        self._wake()

    def poll(self) -> list[KVFetchResult]:
        with self._lock:
            out = list(self._results)
            self._results.clear()
            kept = [r for r in out if r.request_id not in self._cancelled]
            self._cancelled.difference_update(r.request_id for r in out)
            return kept

    def num_fetching(self) -> int:
        """Pulls started and not finished, cancelled or timed out (tests, metrics)."""
        with self._lock:
            return self._num_pending

    def _wake(self) -> None:
        # Called from the engine loop thread only (the socket's single user).
        try:
            self._wake_push.send(b"", zmq.NOBLOCK)
        except zmq.Again:
            pass  # a wake-up is already queued

    def _fetch_loop(self, wake_pull: zmq.Socket) -> None:
        """Every pull in flight at once: one DEALER per source, all multiplexed on one poller,
        so a slow or dead source delays only its own pulls (each has its own deadline)."""
        senders: dict[str, object] = {}  # addr -> its DEALER's signer (and reply verifier)
        poller = zmq.Poller()
        poller.register(wake_pull, zmq.POLLIN)
        dealers: dict[str, zmq.Socket] = {}
        by_socket: dict[zmq.Socket, str] = {}
        last_used: dict[str, float] = {}
        pending: dict[str, _Pull] = {}
        while not self._closed:
            now = time.monotonic()
            with self._lock:
                jobs = list(self._jobs)
                self._jobs.clear()
                cancelled = set(self._cancelled)
            dropped = []  # cancelled before any result: nothing will ever report them
            for request_id, addr, deadline in jobs:
                if request_id in cancelled:
                    dropped.append(request_id)
                    continue
                dealer = dealers.get(addr)
                if dealer is None:
                    dealer = dealers[addr] = self._ctx.socket(zmq.DEALER)
                    dealer.setsockopt(zmq.LINGER, 0)
                    dealer.connect(addr)
                    by_socket[dealer] = addr
                    senders[addr] = (kv_frames.pull_sender(addr), kv_frames.reply_receiver(addr))
                    poller.register(dealer, zmq.POLLIN)
                try:
                    dealer.send(senders[addr][0].encode(KVPull(request_id)), zmq.NOBLOCK)
                except zmq.Again:
                    self._finish(KVFetchResult(request_id, None, 0, 0.0,
                                               error="KV transfer failed: the source's send "
                                                     "queue is full"))
                    continue
                pending[request_id] = _Pull(addr, deadline, now)
                last_used[addr] = now
            for request_id in [r for r in pending if r in cancelled]:
                del pending[request_id]  # cancelled: its late reply is dropped below
                dropped.append(request_id)
            for request_id in [r for r, p in pending.items() if p.deadline <= now]:
                pull = pending.pop(request_id)
                self._finish(KVFetchResult(request_id, None, 0, now - pull.start,
                                           error="KV transfer timed out"))
            self._close_idle(dealers, by_socket, last_used, pending, poller, now)
            with self._lock:
                self._num_pending = len(pending)
                self._cancelled.difference_update(dropped)
            timeout_ms = 500
            if pending:
                next_deadline = min(p.deadline for p in pending.values())
                timeout_ms = max(1, min(timeout_ms, int((next_deadline - now) * 1000) + 1))
            for sock, _ in poller.poll(timeout_ms):
                if sock is wake_pull:
                    while wake_pull.poll(0):
                        wake_pull.recv()
                    continue
                while sock.poll(0):
                    frames = sock.recv_multipart(copy=False)
                    addr = by_socket[sock]
                    result = self._decode_reply(frames, senders[addr][1], pending, addr)
                    if result is not None:
                        self._finish(result)
        for dealer in dealers.values():
            dealer.close(linger=0)
        wake_pull.close(linger=0)

    @staticmethod
    def _decode_reply(frames, receiver, pending: dict, addr: str) -> KVFetchResult | None:
        read = kv_frames.read_reply(receiver, frames)  # None: dropped (and counted)
        if read is None:
            return None
        reply, kv = read
        pull = pending.get(reply.request_id)
        if pull is None or pull.addr != addr:
            return None  # a late reply to a pull that timed out or was cancelled
        del pending[reply.request_id]
        seconds = time.monotonic() - pull.start
        if not reply.ok:
            return KVFetchResult(reply.request_id, None, 0, seconds,
                                 error=f"KV transfer failed: {reply.message}")
        if kv is None:
            return KVFetchResult(reply.request_id, None, 0, seconds,
                                 error="KV transfer failed: reply without a payload")
        return KVFetchResult(reply.request_id, kv, kv.numel() * kv.element_size(), seconds)

    def _finish(self, result: KVFetchResult) -> None:
        with self._lock:
            self._results.append(result)
            if result.error is None:
                self._counts["bytes_received"] += result.num_bytes
                self._counts["num_received"] += 1
                self._counts["receive_seconds_total"] += result.seconds
            else:
                self._counts["num_failed"] += 1

    @staticmethod
    def _close_idle(dealers, by_socket, last_used, pending, poller, now: float) -> None:
        """Sources come and go (restarted workers get new addresses): drop idle DEALERs."""
        busy = {p.addr for p in pending.values()}
        for addr in [a for a in dealers if a not in busy
                     and now - last_used.get(a, now) > IDLE_SOURCE_CLOSE_S]:
            dealer = dealers.pop(addr)
            poller.unregister(dealer)
            del by_socket[dealer]
            last_used.pop(addr, None)
            dealer.close(linger=0)

    # --- common ------------------------------------------------------------------------------
    def stats(self) -> KVTransportStats:
        with self._lock:
            staged_bytes = sum(kv.numel() * kv.element_size() for kv, _ in self._staged.values())
            return KVTransportStats(num_staged=len(self._staged), staged_bytes=staged_bytes,
                                    **self._counts)

    def close(self) -> None:
        self._closed = True
        self._wake()
        for thread in self._threads:
            thread.join(2.0)
        self._wake_push.close(linger=0)
        self._ctx.term()

