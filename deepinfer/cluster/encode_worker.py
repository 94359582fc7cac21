"""Encode workers: the vision tower and projector in a process of their own (the E of E/P/D).

    front ──EncodeImages──▶ EncodeWorkerLoop ──▶ EncodeWorker.step(): batches of images
                                                   │ embeds -> LRU EmbeddingCache
                                                   └────────-> shared store b"mm:"+hash
    front ◀──EncodeWorkerReport(done, load, counters)──┘

`EncodeWorker` is the part without sockets: images whose embeddings are already cached (this
worker's LRU, or the shared store: encoded earlier by any encode worker) are answered at once;
the rest queue in arrival order and are encoded in batches of up to `max_batch_images` images of
one shape. An image asked for twice while queued is encoded once. A request is done when all
its images are in the cache and the store; the front then sends its prefill, and the prefill
worker fetches the embeddings from the store by image hash.

Load: queued images and queued patches (the vision tower's tokens), which is what the encode
router balances. Reports go out after every batch, on every input and at least every
`report_interval_s` (they are also the heartbeat).
"""
from __future__ import annotations

import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from deepinfer.wire.encode_messages import (EncodeCounters, EncodeDone, EncodeImages,
                                               EncodeInput, EncodeWorkerReady,
                                               EncodeWorkerReport)
from deepinfer.wire.worker_messages import AbortRequests, ShutdownWorker, WorkerFailed
from deepinfer.cluster.process_shell import Serving, run_process
from deepinfer.cluster.worker_proc import worker_output_sender
from deepinfer.engine.engine_config import EngineConfig
from deepinfer.multimodal.embedding_cache import STORE_TIER, EmbeddingCache
from deepinfer.multimodal.embedding_store import open_embedding_tier
from deepinfer.wire.mm_inputs import PixelArray
from deepinfer.wire.inbox import drain_messages
from deepinfer.wire import PROCESS_DROPS, ChannelReceiver, channel_name

logger = logging.getLogger(__name__)


class ImageEncoder(Protocol):
    """`encode_images(pixel_values [N, 3, H, W]) -> [N, tokens, hidden]` (LLaVA's contract)."""

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class EncodeWorkerSpec:
    """What an encode worker process needs. `kv_store_url`: the shared store its embeddings
    go to (prefill workers read them there); `cache_bytes`: its LRU of embeddings."""

    worker_id: str
    engine_config: EngineConfig
    input_addr: str
    output_addr: str
    parent_pid: int | None = None
    kv_store_url: str | None = None
    cache_bytes: int = 1 << 30
    max_batch_images: int = 8
    report_interval_s: float = 0.2
    log_level: str = "WARNING"

    def __post_init__(self) -> None:
        if self.max_batch_images < 1 or self.cache_bytes < 0 or self.report_interval_s <= 0:
            raise ValueError("max_batch_images >= 1, cache_bytes >= 0, report_interval_s > 0")


@dataclass
class _Job:
    """One request's images in the queue; `pending`: indices not yet in the cache."""

    message: EncodeImages
    pending: list[int]
    done: EncodeDone
    patches_per_image: int = 0

    @property
    def num_pending_patches(self) -> int:
        return len(self.pending) * self.patches_per_image


@dataclass
class EncodeWorker:
    """Batches, caches and publishes image embeddings (no sockets; see the module docstring)."""

    encoder: ImageEncoder
    cache: EmbeddingCache
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dtype: torch.dtype = torch.float32
    max_batch_images: int = 8
    counters: EncodeCounters = field(default_factory=EncodeCounters)
    _queue: deque[_Job] = field(default_factory=deque)

    def submit(self, message: EncodeImages) -> EncodeDone | None:
        """Queue `message`'s uncached images; its EncodeDone now if none needs encoding."""
        n = len(message.image_hashes)
        done = EncodeDone(message.request_id, num_images=n)
        if n == 0 or len(message.pixel_values) != n:
            self.counters.num_failed += 1
            done.error = f"encode request with {n} image hashes and {len(message.pixel_values)} pixel arrays"
            return done
        self.counters.num_images += n
        pending = [i for i, h in enumerate(message.image_hashes) if not self._lookup(h, done)]
        if not pending:
            return done
        self._queue.append(_Job(message, pending, done, max(1, message.num_patches // n)))
        return None

    def _lookup(self, image_hash: str, done: EncodeDone) -> bool:
        before = dict(self.cache.hits_by_tier)
        if self.cache.get(image_hash) is None:
            self.counters.misses += 1
            return False
        if self.cache.hits_by_tier[STORE_TIER] > before[STORE_TIER]:
            done.num_store_hits += 1
            self.counters.store_hits += 1
        else:
            done.num_local_hits += 1
            self.counters.local_hits += 1
        return True

    def abort(self, request_ids: list[str]) -> None:
        aborted = set(request_ids)
        self._queue = deque(j for j in self._queue if j.message.request_id not in aborted)

    @property
    def has_work(self) -> bool:
        return bool(self._queue)

    @property
    def num_queued_images(self) -> int:
        return sum(len(j.pending) for j in self._queue)

    @property
    def num_queued_patches(self) -> int:
        return sum(j.num_pending_patches for j in self._queue)

    def step(self) -> list[EncodeDone]:
        """Encode one batch (same-shape images from the queue head); the requests it finished."""
        batch: list[tuple[str, PixelArray]] = []
        wanted: set[str] = set()
        shape = None
        for job in self._queue:
            for i in job.pending:
                image_hash = job.message.image_hashes[i]
                if image_hash in wanted or image_hash in self.cache:
                    continue
                pixels = job.message.pixel_values[i]
                shape = shape or tuple(pixels.shape)
                if tuple(pixels.shape) != shape or len(batch) >= self.max_batch_images:
                    continue
                batch.append((image_hash, pixels))
                wanted.add(image_hash)
        failed: str | None = None
        encode_s = 0.0
        if batch:
            try:
                encode_s = self._encode(batch)
            except Exception as exc:  # a bad image must fail its requests, not the worker
                logger.exception("encoding %d images failed", len(batch))
                failed = f"image encoding failed: {type(exc).__name__}: {exc}"
        return self._collect(wanted, failed, encode_s / max(1, len(batch)))

    def _encode(self, batch: list[tuple[str, PixelArray]]) -> float:
        arrays = np.stack([p.to_numpy() for _, p in batch])
        pixel_values = torch.from_numpy(arrays).to(self.device, self.dtype)  # [N, 3, H, W]
        start = time.perf_counter()
        with torch.inference_mode():
            embeds = self.encoder.encode_images(pixel_values)  # [N, tokens, hidden]
        if embeds.device.type == "cuda":
            torch.cuda.synchronize(embeds.device)
        elapsed = time.perf_counter() - start
        for (image_hash, _), rows in zip(batch, embeds):
            self.cache.put(image_hash, rows.clone())  # local LRU and the shared store
        c = self.counters
        c.num_images_encoded += len(batch)
        c.num_batches += 1
        c.encode_seconds_total += elapsed
        return elapsed

    def _collect(self, encoded: set[str], failed: str | None, s_per_image: float) -> list[EncodeDone]:
        finished: list[EncodeDone] = []
        still: deque[_Job] = deque()
        for job in self._queue:
            hashes = job.message.image_hashes
            mine = [i for i in job.pending if hashes[i] in encoded]
            job.done.encode_s += s_per_image * len(mine)
            if failed is not None and mine:
                job.done.error = failed
                self.counters.num_failed += 1
                finished.append(job.done)
                continue
            job.pending = [i for i in job.pending if hashes[i] not in encoded and hashes[i] not in self.cache]
            if job.pending:
                still.append(job)
            else:
                finished.append(job.done)
        self._queue = still
        return finished


# --- the process -----------------------------------------------------------------------------
def load_image_encoder(config: EngineConfig):
    """(model with `encode_images`, device, dtype, ModelSource) for `config.model`."""
    from deepinfer.engine.llm_engine import resolve_device
    from deepinfer.runtime.model_source import load_model, resolve_model

    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    source = resolve_model(config.model)
    device, dtype = resolve_device(config.device), getattr(torch, config.dtype)
    model = load_model(source, dtype, device)
    if not callable(getattr(model, "encode_images", None)):
        raise ValueError(f"{source.name} has no vision tower: encode workers need a "
                         f"vision-language model (e.g. LLaVA)")
    return VisionOnly.of(model), device, dtype, source


class VisionOnly:
    """The vision tower and projector of a LLaVA-style model, without its language model
    (dropped once loaded: an encode worker never runs it). `encode_images` is the model's own."""

    PARTS = ("vision_config", "vision_tower", "multi_modal_projector")

    def __init__(self, model) -> None:
        for name in self.PARTS:
            setattr(self, name, getattr(model, name))
        self._encode = type(model).encode_images

    @classmethod
    def of(cls, model):
        """`model` itself when it has no such parts (another architecture's encoder)."""
        return cls(model) if all(hasattr(model, n) for n in cls.PARTS) else model

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self._encode(self, pixel_values)  # [N, tokens, hidden]


class EncodeWorkerLoop:
    """Sockets around an `EncodeWorker`: drain inputs, encode a batch, report."""

    def __init__(self, spec: EncodeWorkerSpec, worker: EncodeWorker, input_socket, output_socket):
        self.spec = spec
        self.worker = worker
        self.input_socket = input_socket
        self.output_socket = output_socket
        self.encoder = worker_output_sender(spec.output_addr)
        self.decoder = ChannelReceiver(channel_name("worker.input", spec.input_addr),
                                       EncodeInput)
        self._done: list[EncodeDone] = []
        self._dirty = True
        self._last_report = 0.0

    def run(self) -> None:
        while True:
            timeout_ms = 0 if self.worker.has_work else int(self.spec.report_interval_s * 1000)
            if not drain_messages(self.input_socket, self.decoder.decode, timeout_ms, self._on_message):
                return
            if self.worker.has_work:
                finished = self.worker.step()
                self._done.extend(finished)
                self._dirty = True
            if self._dirty or time.monotonic() - self._last_report >= self.spec.report_interval_s:
                self.send_report()
            if self.spec.parent_pid is not None and os.getppid() != self.spec.parent_pid:
                logger.warning("front process is gone; %s exiting", self.spec.worker_id)
                return

    def _on_message(self, message) -> bool:
        if isinstance(message, ShutdownWorker):
            return False
        self._dirty = True
        if isinstance(message, AbortRequests):
            self.worker.abort(message.request_ids)
        elif isinstance(message, EncodeImages):
            done = self.worker.submit(message)
            if done is not None:
                self._done.append(done)
        return True

    def send_report(self) -> None:
        self.worker.counters.wire_frames_dropped = PROCESS_DROPS.as_report()
        report = EncodeWorkerReport(
            worker_id=self.spec.worker_id, num_queued_images=self.worker.num_queued_images,
            num_queued_patches=self.worker.num_queued_patches, counters=self.worker.counters,
            done=self._done)
        self.output_socket.send(self.encoder.encode(report), copy=False)
        self._done, self._dirty, self._last_report = [], False, time.monotonic()


def run_encode_worker_proc(spec: EncodeWorkerSpec) -> None:
    """Spawn target. Exits on ShutdownWorker, when the front is gone, or on error (after
    sending `WorkerFailed`)."""
    def build(ctx, input_socket, output_socket) -> Serving:
        model, device, dtype, source = load_image_encoder(spec.engine_config)
        tier = open_embedding_tier(spec.kv_store_url, source)
        worker = EncodeWorker(model, EmbeddingCache(spec.cache_bytes, store=tier), device, dtype,
                              spec.max_batch_images)
        loop = EncodeWorkerLoop(spec, worker, input_socket, output_socket)
        return Serving(EncodeWorkerReady(spec.worker_id, os.getpid(),
                                         embedding_store=tier is not None),
                       loop.run, [tier.close] if tier is not None else [])

    run_process(spec.worker_id, spec.log_level, spec.input_addr, spec.output_addr,
                "worker.output", build, lambda message: WorkerFailed(spec.worker_id, message),
                hello=True)
