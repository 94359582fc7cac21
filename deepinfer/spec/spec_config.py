"""Speculative decoding configuration, shaped like vLLM's `--speculative-config`. Pure.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    {"method": "draft_model", "num_speculative_tokens": 4, "model": "/path/to/small-model"}
    {"method": "mtp", "num_speculative_tokens": 2}      (DeepSeek-V3 checkpoints; alias "deepseek_mtp")
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model", "mtp")
_ALIASES = {"deepseek_mtp": "mtp", "[ngram]": "ngram", "draft": "draft_model"}
MAX_SPECULATIVE_TOKENS = 32


@dataclass(frozen=True)
class SpeculativeConfig:
    """`model`: the draft checkpoint for draft_model (None: the target's own model and
    weights, drafting for itself with its own KV cache). Prompt-lookup bounds default as in
    vLLM: both 5 when neither is given, else the one given."""

    method: str
    num_speculative_tokens: int | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None

    def __post_init__(self) -> None:
        method = _ALIASES.get(self.method, self.method)
        if method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        object.__setattr__(self, "method", method)
        k = self.num_speculative_tokens
        if k is None:
            if method != "mtp":
                raise ValueError(f"speculative method {method!r} needs num_speculative_tokens")
            k = 1
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be an integer in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        object.__setattr__(self, "num_speculative_tokens", k)
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if method == "ngram":
            lo, hi = (5, 5) if lo is None and hi is None else (lo if lo is not None else hi,
                                                                hi if hi is not None else lo)
            for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ValueError(f"{name} must be a positive integer, got {value!r}")
            if lo > hi:
                raise ValueError(f"prompt_lookup_min ({lo}) > prompt_lookup_max ({hi})")
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
        elif lo is not None or hi is not None:
            raise ValueError("prompt_lookup_min / prompt_lookup_max apply to method 'ngram' only")
        if self.model is not None and method != "draft_model":
            raise ValueError("'model' applies to method 'draft_model' only")

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots a drafter model writes past the verified tokens (none for n-gram)."""
        return 0 if self.method == "ngram" else self.num_speculative_tokens

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None
              ) -> SpeculativeConfig | None:
        """From a config, a dict or a JSON object string (None stays None); ValueError for a
        malformed value or an unknown key."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("speculative config must be a JSON object, e.g. "
                             '{"method": "ngram", "num_speculative_tokens": 4}')
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative config keys {unknown}; known: {sorted(known)}")
        if "method" not in value:
            raise ValueError("speculative config needs a 'method'")
        return cls(**value)
