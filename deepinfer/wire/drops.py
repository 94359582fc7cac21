"""Counting and logging dropped frames.

One `DropCounter` per process (`PROCESS_DROPS`), shared by every verifier in it, the way the
Prometheus client keeps one default registry: the front's /metrics reads it, and worker and
engine processes copy it into the stats they report so the front can show theirs too.
Each (channel, reason) is logged at most once per `LOG_INTERVAL_S`, so a flood of bad frames
cannot flood the log.
"""
from __future__ import annotations

import logging
import threading
import time

logger = logging.getLogger("deepinfer.wire")

LOG_INTERVAL_S = 60.0

# Why a frame was dropped (the `reason` label).
TRUNCATED = "truncated"  # shorter than a frame header
OVERSIZE = "oversize"  # larger than the channel allows
VERSION = "version"  # unknown frame format version
KEY = "key"  # signed with another key (another deployment, or a stale secret)
MAC = "mac"  # the MAC does not match: forged or tampered
REPLAY = "replay"  # a sequence number this receiver has already seen from that sender
DECODE = "decode"  # authentic but not valid msgpack
TYPE = "type"  # decodes, but not as a message of this channel (or fails its validation)
FRAMES = "frames"  # a multipart message with the wrong number of parts
INVALID = "invalid"  # well-formed, but its content is inconsistent (sizes, dtypes, ids)
HELLO = "hello"  # a signed hello that fails its challenge (worker, nonce, already bound)
SENDER_MISMATCH = "sender_mismatch"  # names another worker than the one on its connection
REASONS = (TRUNCATED, OVERSIZE, VERSION, KEY, MAC, REPLAY, DECODE, TYPE, FRAMES, INVALID,
           HELLO, SENDER_MISMATCH)


def channel_label(channel: str) -> str:
    """The metric label of a channel name: its kind, without the endpoint after '@' (bounded
    label cardinality)."""
    return channel.split("@", 1)[0]


class DropCounter:
    """Thread-safe counts of dropped frames by (channel kind, reason)."""

    def __init__(self, log_interval_s: float = LOG_INTERVAL_S) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str], int] = {}
        self._last_log: dict[tuple[str, str], float] = {}
        self.log_interval_s = log_interval_s

    def record(self, channel: str, reason: str, detail: str = "") -> None:
        key = (channel_label(channel), reason)
        now = time.monotonic()
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + 1
            last = self._last_log.get(key)
            should_log = last is None or now - last >= self.log_interval_s
            if should_log:
                self._last_log[key] = now
            count = self._counts[key]
        if should_log:
            logger.warning("dropped a frame on %s: %s%s (%d so far)", channel, reason,
                           f" ({detail})" if detail else "", count)

    def snapshot(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._counts)

    def as_report(self) -> dict[str, int]:
        """For a stats message: {"channel/reason": count}."""
        return {f"{c}/{r}": n for (c, r), n in self.snapshot().items()}


def merge_reports(*reports: dict[str, int]) -> dict[tuple[str, str], int]:
    """Sum `as_report()` dicts (several processes) into {(channel, reason): count}; keys that
    do not parse are ignored (they came over a socket)."""
    total: dict[tuple[str, str], int] = {}
    for report in reports:
        for name, count in report.items():
            channel, sep, reason = name.rpartition("/")
            if sep and reason in REASONS and isinstance(count, int) and count >= 0:
                total[(channel, reason)] = total.get((channel, reason), 0) + count
    return total



def sum_reports(reports) -> dict[str, int]:
    """Several processes' `as_report()` dicts summed, in the same shape (for a stats struct)."""
    return {f"{c}/{r}": n for (c, r), n in merge_reports(*reports).items()}


PROCESS_DROPS = DropCounter()
