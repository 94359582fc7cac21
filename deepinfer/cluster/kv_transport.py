"""`KVTransport`: moves a request's prompt KV blocks from a prefill worker to a decode worker.

The prefill side *stages* a copy of the request's blocks in host memory (so its device blocks
are freed at once and stay in its prefix cache) and serves it to whoever pulls it; a staged
payload that is not pulled within `ttl_s` is dropped. The decode side allocates its blocks
first, then *fetches* (pulls) the payload with a timeout; results are polled by its engine
loop, which writes them into the allocated blocks.

`ZmqKVTransport` (default) serves pulls on a ROUTER socket over TCP from a background thread
and fetches on another thread with one DEALER per source; payloads travel as raw frames
(no pickling, one copy on each side).
"""
from __future__ import annotations

import logging
import threading
import time
import warnings
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass

import torch
import zmq

from deepinfer.cluster.messages import KVPull, KVPullReply
from deepinfer.kvstore.tensor_codec import _torch_dtype

logger = logging.getLogger(__name__)


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
        self._jobs_cond = threading.Condition(self._lock)
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
        self._start(self._fetch_loop, None, "kv-fetch")

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
        encoder, decoder = _codec(KVPull)
        while not self._closed:
            self._expire()
            if not router.poll(100):
                continue
            identity, frame = router.recv_multipart()
            try:
                pull = decoder.decode(frame)
            except Exception as exc:  # a bad frame must not stop the server
                logger.warning("kv transport: bad pull message: %s", exc)
                continue
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
            router.send_multipart([identity, encoder.encode(reply), raw], copy=False)
            with self._lock:
                self._counts["bytes_sent"] += raw.nbytes
                self._counts["num_sent"] += 1

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            for request_id in [r for r, (_, d) in self._staged.items() if d < now]:
                del self._staged[request_id]
                self._counts["num_expired"] += 1
                logger.warning("kv transport: staged KV of %s expired unpulled", request_id)

    # --- decode side -------------------------------------------------------------------------
    def fetch(self, request_id: str, source_addr: str, timeout_s: float) -> None:
        with self._jobs_cond:
            self._cancelled.discard(request_id)
            self._jobs.append((request_id, source_addr, time.monotonic() + timeout_s))
            self._jobs_cond.notify()

    def cancel_fetch(self, request_id: str) -> None:
        with self._lock:
            self._cancelled.add(request_id)

    def poll(self) -> list[KVFetchResult]:
        with self._lock:
            out = list(self._results)
            self._results.clear()
            return [r for r in out if r.request_id not in self._cancelled]

    def _fetch_loop(self) -> None:
        encoder, decoder = _codec(KVPullReply)
        dealers: dict[str, zmq.Socket] = {}
        while True:
            with self._jobs_cond:
                self._jobs_cond.wait_for(lambda: self._jobs or self._closed, timeout=0.5)
                if self._closed:
                    break
                if not self._jobs:
                    continue
                request_id, addr, deadline = self._jobs.popleft()
                if request_id in self._cancelled:
                    continue
            if addr not in dealers:
                dealers[addr] = self._ctx.socket(zmq.DEALER)
                dealers[addr].setsockopt(zmq.LINGER, 0)
                dealers[addr].connect(addr)
            result = self._fetch_one(dealers[addr], encoder, decoder, request_id, deadline)
            with self._lock:
                self._results.append(result)
                if result.error is None:
                    self._counts["bytes_received"] += result.num_bytes
                    self._counts["num_received"] += 1
                    self._counts["receive_seconds_total"] += result.seconds
                else:
                    self._counts["num_failed"] += 1
        for dealer in dealers.values():
            dealer.close(linger=0)

    def _fetch_one(self, dealer: zmq.Socket, encoder, decoder, request_id: str,
                   deadline: float) -> KVFetchResult:
        start = time.monotonic()
        dealer.send(encoder.encode(KVPull(request_id)))
        while True:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0 or not dealer.poll(remaining_ms):
                return KVFetchResult(request_id, None, 0, time.monotonic() - start,
                                     error="KV transfer timed out")
            frames = dealer.recv_multipart(copy=False)
            reply = decoder.decode(frames[0].bytes)
            if reply.request_id != request_id:
                continue  # a late reply to an earlier, timed-out pull
            if not reply.ok:
                return KVFetchResult(request_id, None, 0, time.monotonic() - start,
                                     error=f"KV transfer failed: {reply.message}")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # read-only frame buffer; we only read it
                raw = torch.frombuffer(frames[1].buffer, dtype=torch.uint8)
            kv = raw.view(_torch_dtype(reply.dtype)).reshape(reply.shape)
            return KVFetchResult(request_id, kv, raw.numel(), time.monotonic() - start)

    # --- common ------------------------------------------------------------------------------
    def stats(self) -> KVTransportStats:
        with self._lock:
            staged_bytes = sum(kv.numel() * kv.element_size() for kv, _ in self._staged.values())
            return KVTransportStats(num_staged=len(self._staged), staged_bytes=staged_bytes,
                                    **self._counts)

    def close(self) -> None:
        with self._jobs_cond:
            self._closed = True
            self._jobs_cond.notify_all()
        for thread in self._threads:
            thread.join(2.0)
        self._ctx.term()


def _codec(message_type):
    import msgspec
    return msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(message_type)
