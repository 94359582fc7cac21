"""Sampling parameters (vLLM-shaped). Pure: no torch."""
from __future__ import annotations

from dataclasses import dataclass, field

MIN_TEMPERATURE = 1e-5  # lower temperatures sample greedily
MIN_TOP_P = 1e-7  # smaller top_p keeps just the top token, as this does


@dataclass
class SamplingParams:
    """How to sample one request. Validated on construction; bad values raise ValueError.

    Semantics follow vLLM: `temperature == 0` is greedy; `ignore_eos` keeps generating past EOS
    (EOS can still be sampled); `min_tokens` masks EOS and stop tokens until reached;
    `logprobs=k` returns the sampled token's log-probability and the top-k alternatives.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()
        # Below these the float32 sampler would divide into inf/nan; the results are the same
        # as greedy / keeping only the top token, so map them there (as vLLM does).
        if self.temperature < MIN_TEMPERATURE:
            self.temperature = 0.0
        self.top_p = max(self.top_p, MIN_TOP_P)

    def _validate(self) -> None:
        checks = [
            (self.n >= 1, "n must be at least 1"),
            (self.temperature >= 0.0, "temperature must be non-negative"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (self.top_k >= 0, "top_k must be -1 (disabled) or positive"),
            (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens must be at least 1"),
            (self.min_tokens >= 0, "min_tokens must be non-negative"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens,
             "min_tokens must not exceed max_tokens"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs must be in [0, 20]"),
            (all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
