"""Typed messages between the front and its encode workers (msgpack via msgspec).

    front ──EncodeInput──▶ encode worker            PUSH/PULL, one channel per worker
    front ◀──EncodeWorkerMessage── encode workers   PUSH/PULL, one shared channel

The front sends the preprocessed pixels of a request's images (`EncodeImages`); the worker
answers, in its next `EncodeWorkerReport`, with an `EncodeDone` once every image's embeddings
are in its cache and in the shared store (so any prefill worker can fetch them by hash).
Encode messages have their own channel, apart from prefill/decode `WorkerMessage`s.
"""
from __future__ import annotations

import msgspec

from deepinfer.wire.worker_messages import AbortRequests, ShutdownWorker, WorkerFailed
from deepinfer.wire.mm_inputs import PixelArray

# --- front -> encode worker ----------------------------------------------------------------


class EncodeImages(msgspec.Struct, tag=True):
    """Encode these images (one pixel array per hash); `num_patches`: vision tokens in all."""

    request_id: str
    image_hashes: list[str]
    pixel_values: list[PixelArray]
    num_patches: int = 0


EncodeInput = EncodeImages | AbortRequests | ShutdownWorker

# --- encode worker -> front ----------------------------------------------------------------


class EncodeWorkerReady(msgspec.Struct, tag=True):
    worker_id: str
    pid: int
    embedding_store: bool  # embeddings are published to a shared store


class EncodeDone(msgspec.Struct):
    """Every image of `request_id` is encoded (or was cached); `error` set: it failed."""

    request_id: str
    num_images: int
    num_local_hits: int = 0  # found in the worker's LRU cache
    num_store_hits: int = 0  # found in the shared store (encoded earlier, anywhere)
    encode_s: float = 0.0  # time spent in the vision tower for this request's misses
    error: str | None = None


class EncodeCounters(msgspec.Struct):
    """Cumulative counters of one encode worker (metrics)."""

    num_images: int = 0  # images asked for
    num_images_encoded: int = 0  # ran through the vision tower
    num_batches: int = 0
    encode_seconds_total: float = 0.0
    local_hits: int = 0
    store_hits: int = 0
    misses: int = 0
    num_failed: int = 0
    wire_frames_dropped: dict[str, int] = {}  # this process's, "channel/reason" -> count


class EncodeWorkerReport(msgspec.Struct, tag=True):
    """Load (queued images and patches), counters and finished requests; also a heartbeat."""

    worker_id: str
    num_queued_images: int
    num_queued_patches: int
    counters: EncodeCounters
    done: list[EncodeDone] = []


EncodeWorkerMessage = EncodeWorkerReady | EncodeWorkerReport | WorkerFailed


def encode_input_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(EncodeInput)


def encode_worker_message_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(EncodeWorkerMessage)
