"""Production trace rows → benchmark requests: rows, shrinking, prefix tokens (the file formats
are read by trace_formats.py).

A trace with `hash_ids` holds one id per block of its own size (Mooncake 512 tokens, Bailian
16); equal ids mean equal blocks. We give every distinct id its own block of token ids, derived
only from (seed, id), and concatenate: requests then share exactly the token prefixes the trace
says they share. Shrinking (`length_scale`) scales the trace's block size together with the
lengths, so the sharing structure survives; `max_input_len` truncates prompts, which keeps
prefixes shared. Pure: stdlib + numpy.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class TraceRow:
    """One trace request before tokens are made: times in seconds from the earliest row."""

    timestamp_s: float
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...] | None = None  # None: no prefix information (Azure, BurstGPT)


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

    def block_tokens(self, trace_block_tokens: int) -> int:
        """The trace's hash block size scaled with the lengths (at least one token)."""
        return max(1, round(trace_block_tokens * self.length_scale))

    def input_len(self, n: int) -> int:
        n = max(1, round(n * self.length_scale))
        return min(n, self.max_input_len) if self.max_input_len else n

    def output_len(self, n: int) -> int:
        n = max(1, round(n * self.length_scale))
        return min(n, self.max_output_len) if self.max_output_len else n

    def describe(self, trace_block_tokens: int | None = None) -> str:
        parts = []
        if self.length_scale != 1.0:
            text = f"lengths x{self.length_scale:g}"
            if trace_block_tokens:
                block = self.block_tokens(trace_block_tokens)
                text += f" (hash block {trace_block_tokens} -> {block} tokens"
                exact = trace_block_tokens * self.length_scale
                if abs(block / exact - 1) > 0.25:  # rounding moved where shared prefixes end
                    text += (f", x{block / trace_block_tokens:g} not x{self.length_scale:g}: "
                             f"prefix sharing {'over' if block > exact else 'under'}stated")
                text += ")"
            parts.append(text)
        if self.max_input_len:
            parts.append(f"prompts truncated to {self.max_input_len} tokens")
        if self.max_output_len:
            parts.append(f"outputs capped at {self.max_output_len} tokens")
        return "; ".join(parts) or "unchanged"


def spread_ticks(timestamps: list[float]) -> list[float]:
    """Spread runs of equal timestamps evenly over the gap to the next distinct timestamp
    (the last run uses the median gap); the result counts from the earliest, 0."""
    if not timestamps:
        return []
    start = min(timestamps)
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
