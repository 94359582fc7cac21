"""How much more CPU a small decode step costs while another worker steps on another core. Pure.

A fused small decode step streams the whole model's weights; two such steps at the same time on
two cores share the memory bandwidth / L3 and slow each other (+20-25% CPU measured here), while
a compute-bound prefill next door barely does (`benchmarks/decode_contention.py`,
`deepinfer profile --memory-contention`: steps per CPU-second with a neighbour / alone). The
simulator multiplies a worker's speed, during a `decode`-kind step (sim.time_sharing's kinds),
by `decode_with_decode` while any other busy worker is in a decode-only step, else by
`decode_with_prefill` while one is in a prefill step; other steps are unaffected
(`host: {memory_contention: measured | {decode_with_decode: .., decode_with_prefill: ..}}`).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from deepinfer.sim.time_sharing import DEFAULT_SMALL_DECODE_ROWS, step_kind

KEYS = ("decode_with_decode", "decode_with_prefill")


@dataclass(frozen=True)
class MemoryContention:
    decode_with_decode: float
    decode_with_prefill: float
    small_decode_rows: int = DEFAULT_SMALL_DECODE_ROWS  # the profile's fused-stack limit

    def __post_init__(self) -> None:
        for key in KEYS:
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or isinstance(value, bool) \
                    or not 0.0 < value <= 1.0:
                raise ValueError(f"memory_contention.{key} must be in (0, 1], got {value!r}")
        if self.small_decode_rows < 0:
            raise ValueError("memory_contention: small_decode_rows must be >= 0")

    def kind(self, chunks) -> str:
        return step_kind(chunks, self.small_decode_rows)

    def efficiency(self, kind: str, other_kinds: Iterable[str]) -> float:
        """A step of `kind` (sim.time_sharing kinds) while the other busy workers run steps of
        `other_kinds`."""
        if kind != "decode":
            return 1.0
        others = set(other_kinds)
        if others & {"decode", "large_decode"}:
            return float(self.decode_with_decode)
        if "prefill" in others:
            return float(self.decode_with_prefill)
        return 1.0


def memory_contention_from_dict(data: dict, small_decode_rows: int | None = None
                                ) -> MemoryContention:
    """From a profile's `memory_contention` metadata (extra keys such as method kept out) or a
    cluster file's numbers; ValueError if a number is missing or outside (0, 1]."""
    if not isinstance(data, dict):
        raise ValueError(f"memory_contention must be a mapping, got {type(data).__name__}")
    missing = [k for k in KEYS if k not in data]
    if missing:
        raise ValueError(f"memory_contention needs {', '.join(missing)}")
    rows = small_decode_rows if small_decode_rows is not None else DEFAULT_SMALL_DECODE_ROWS
    return MemoryContention(**{k: data[k] for k in KEYS}, small_decode_rows=rows)
