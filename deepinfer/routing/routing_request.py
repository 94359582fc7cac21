"""`RoutingRequest`: what a router needs to know about one request. Pure."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RoutingRequest:
    """A request as the routers see it.

    `block_hashes` are the request's chained full-block hashes (`core.prefix_hash`), used by
    `cache-affinity`. `num_cached_tokens_hint` is the number of leading prompt tokens known to
    be cached in the shared prefix store (cheap for any prefill worker), or None if unknown.
    `expected_output_tokens` is what the decode router reserves for the output (e.g. max_tokens,
    or a running average when max_tokens is absent).
    """

    request_id: str
    num_prompt_tokens: int
    block_hashes: tuple[bytes, ...] = field(default=())
    expected_output_tokens: int = 0
    num_cached_tokens_hint: int | None = None

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 1:
            raise ValueError(f"num_prompt_tokens must be >= 1, got {self.num_prompt_tokens}")
        if self.expected_output_tokens < 0:
            raise ValueError("expected_output_tokens must be >= 0")
        if self.num_cached_tokens_hint is not None and not (
                0 <= self.num_cached_tokens_hint <= self.num_prompt_tokens):
            raise ValueError("num_cached_tokens_hint must be in [0, num_prompt_tokens]")
        # Accept any sequence but store a tuple so the dataclass stays hashable and immutable.
        object.__setattr__(self, "block_hashes", tuple(self.block_hashes))

    @property
    def num_cached_tokens(self) -> int:
        return self.num_cached_tokens_hint or 0

    @property
    def num_uncached_tokens(self) -> int:
        return self.num_prompt_tokens - self.num_cached_tokens

    @property
    def num_reserved_kv_tokens(self) -> int:
        """KV a decode worker will hold for this request at most: prompt + expected output."""
        return self.num_prompt_tokens + self.expected_output_tokens
