"""How much more CPU a step costs while its core is time-shared with another busy thread. Pure.

Two busy threads on one core evict each other's caches at every switch, so each step does less
work per CPU-second than alone (`deepinfer profile --time-sharing` measures it with the real
runner: steps per CPU-second with a competing process pinned to the same core / alone). The
simulator multiplies a worker's speed by its step's efficiency whenever the busy threads exceed
the host's cores (`host: {time_sharing: measured | {decode: .., prefill: ..}}`).

Step kinds follow the piecewise cost model: `decode` = decode-only steps of at most
`small_decode_rows` rows (the fused decode stack), `large_decode` = larger decode-only steps
(per-op path; as `prefill` when not given), `prefill` = any step with a chunk of > 1 token.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

KINDS = ("decode", "large_decode", "prefill")
DEFAULT_SMALL_DECODE_ROWS = 8


@dataclass(frozen=True)
class TimeSharing:
    decode: float
    prefill: float
    large_decode: float | None = None  # None: as prefill
    small_decode_rows: int = DEFAULT_SMALL_DECODE_ROWS

    def __post_init__(self) -> None:
        for kind in KINDS:
            value = getattr(self, kind)
            if value is None and kind == "large_decode":
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool) \
                    or not 0.0 < value <= 1.0:
                raise ValueError(f"time_sharing.{kind} must be in (0, 1], got {value!r}")
        if self.small_decode_rows < 0:
            raise ValueError("time_sharing: small_decode_rows must be >= 0")

    def kind(self, chunks: Sequence) -> str:
        return step_kind(chunks, self.small_decode_rows)

    def efficiency(self, chunks: Sequence) -> float:
        kind = self.kind(chunks)
        value = getattr(self, kind)
        return float(self.prefill if value is None else value)


def step_kind(chunks: Sequence, small_decode_rows: int = DEFAULT_SMALL_DECODE_ROWS) -> str:
    """`decode`, `large_decode` or `prefill` (see the module doc)."""
    if chunks and all(c.num_new_tokens == 1 for c in chunks):
        return "decode" if len(chunks) <= small_decode_rows else "large_decode"
    return "prefill"


def time_sharing_from_dict(data: dict, small_decode_rows: int | None = None) -> TimeSharing:
    """From a profile's `time_sharing` metadata or a cluster file's numbers; ValueError on
    unknown keys or values outside (0, 1]. Extra profile keys (method, samples) are kept out."""
    if not isinstance(data, dict):
        raise ValueError(f"time_sharing must be a mapping, got {type(data).__name__}")
    missing = [k for k in ("decode", "prefill") if k not in data]
    if missing:
        raise ValueError(f"time_sharing needs {', '.join(missing)}")
    rows = small_decode_rows if small_decode_rows is not None else DEFAULT_SMALL_DECODE_ROWS
    return TimeSharing(decode=data["decode"], prefill=data["prefill"],
                       large_decode=data.get("large_decode"), small_decode_rows=rows)
