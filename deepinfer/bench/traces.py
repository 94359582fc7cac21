"""Production traces → benchmark requests: Mooncake JSONL (with prefix `hash_ids`) and Azure CSV.

Mooncake rows hold one hash id per 512-token block; equal ids mean equal blocks, and ids are
chained (a shared id implies the whole prefix before it is shared). We give every distinct id
its own block of token ids, derived only from (seed, id), and concatenate: requests then share
exactly the token prefixes the trace says they share. Shrinking (`length_scale`) scales the
block size together with the lengths, so the sharing structure survives; `max_input_len`
truncates prompts, which keeps prefixes shared. Pure: stdlib + numpy.
"""
from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from datetime import datetime

import numpy as np

MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class TraceRow:
    """One trace request before tokens are made: times in seconds from the first row."""

    timestamp_s: float
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...] | None = None  # None: no prefix information (Azure)


@dataclass(frozen=True)
class ShrinkConfig:
    """How to make a production trace fit a small model. Defaults change nothing."""

    length_scale: float = 1.0
    max_input_len: int | None = None
    max_output_len: int | None = None

    def __post_init__(self) -> None:
        if self.length_scale <= 0:
            raise ValueError("length_scale must be positive")
        for name in ("max_input_len", "max_output_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1")

    @property
    def block_tokens(self) -> int:
        return max(1, round(MOONCAKE_BLOCK_TOKENS * self.length_scale))

    def input_len(self, n: int) -> int:
        n = max(1, round(n * self.length_scale))
        return min(n, self.max_input_len) if self.max_input_len else n

    def output_len(self, n: int) -> int:
        n = max(1, round(n * self.length_scale))
        return min(n, self.max_output_len) if self.max_output_len else n

    def describe(self) -> str:
        parts = []
        if self.length_scale != 1.0:
            parts.append(f"lengths x{self.length_scale:g} (hash block {MOONCAKE_BLOCK_TOKENS} -> "
                         f"{self.block_tokens} tokens)")
        if self.max_input_len:
            parts.append(f"prompts truncated to {self.max_input_len} tokens")
        if self.max_output_len:
            parts.append(f"outputs capped at {self.max_output_len} tokens")
        return "; ".join(parts) or "unchanged"


def read_mooncake_jsonl(path: str, limit: int | None = None) -> list[TraceRow]:
    """Rows of a Mooncake trace. Timestamps (ms) are quantized to ticks; requests sharing a
    tick are spread evenly over it so they do not all arrive at once."""
    raw = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            if limit is not None and len(raw) >= limit:
                break
            try:
                obj = json.loads(line)
                raw.append((float(obj["timestamp"]) / 1000.0, int(obj["input_length"]),
                            int(obj["output_length"]), tuple(int(h) for h in obj["hash_ids"])))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{line_no}: not a Mooncake trace row ({e})") from None
    times = spread_ticks([r[0] for r in raw])
    return [TraceRow(t, r[1], r[2], r[3]) for t, r in zip(times, raw)]


def spread_ticks(timestamps: list[float]) -> list[float]:
    """Spread runs of equal timestamps evenly over the gap to the next distinct timestamp
    (the last run uses the median gap); the result starts at 0."""
    if not timestamps:
        return []
    start = timestamps[0]
    distinct = sorted(set(timestamps))
    gaps = np.diff(distinct)
    default_gap = float(np.median(gaps)) if len(gaps) else 0.0
    next_time = {t: (distinct[i + 1] if i + 1 < len(distinct) else t + default_gap)
                 for i, t in enumerate(distinct)}
    counts: dict[float, int] = {}
    for t in timestamps:
        counts[t] = counts.get(t, 0) + 1
    seen: dict[float, int] = {}
    out = []
    for t in timestamps:
        k = seen.get(t, 0)
        seen[t] = k + 1
        out.append(t - start + (next_time[t] - t) * k / counts[t])
    return out


def read_azure_csv(path: str, limit: int | None = None) -> list[TraceRow]:
    """Rows of an Azure LLM inference trace (TIMESTAMP,ContextTokens,GeneratedTokens)."""
    rows = []
    with open(path, newline="") as f:
        for line_no, rec in enumerate(csv.DictReader(f), 2):
            if limit is not None and len(rows) >= limit:
                break
            try:
                rows.append((_parse_azure_time(rec["TIMESTAMP"]), int(rec["ContextTokens"]),
                             int(rec["GeneratedTokens"])))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{line_no}: not an Azure trace row ({e})") from None
    if not rows:
        return []
    start = rows[0][0]
    return [TraceRow(t - start, i, o) for t, i, o in rows]


def _parse_azure_time(text: str) -> float:
    """'2023-11-16 18:15:46.6805900' (7 fractional digits) → POSIX seconds."""
    whole, _, frac = text.strip().partition(".")
    base = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").timestamp()
    return base + (float(f"0.{frac}") if frac else 0.0)


class HashBlockTokens:
    """Token ids for hash-id blocks: block `h` is the same on every call and every machine."""

    def __init__(self, block_tokens: int, token_id_low: int, token_id_high: int,
                 seed: int = 0) -> None:
        if not 0 <= token_id_low < token_id_high:
            raise ValueError("need 0 <= token_id_low < token_id_high")
        self.block_tokens = block_tokens
        self.low, self.high, self.seed = token_id_low, token_id_high, seed
        self._blocks: dict[int, np.ndarray] = {}

    def block(self, hash_id: int) -> np.ndarray:
        tokens = self._blocks.get(hash_id)
        if tokens is None:
            rng = np.random.default_rng([self.seed, hash_id])
            tokens = rng.integers(self.low, self.high, self.block_tokens)
            self._blocks[hash_id] = tokens
        return tokens

    def prompt(self, hash_ids: tuple[int, ...], input_len: int,
               rng: np.random.Generator) -> list[int]:
        """The blocks of `hash_ids` concatenated and cut to `input_len`; if the blocks are too
        few, the rest is random tokens private to this request."""
        num_blocks = min(len(hash_ids), -(-input_len // self.block_tokens))
        parts = [self.block(h) for h in hash_ids[:num_blocks]]
        tokens = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
        if len(tokens) < input_len:
            tokens = np.concatenate([tokens, rng.integers(self.low, self.high,
                                                          input_len - len(tokens))])
        return tokens[:input_len].tolist()
