"""Sampling parameters (vLLM-shaped). Pure: no torch."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from deepinfer.invalid_parameter import InvalidParameter
from deepinfer.structured.params import StructuredOutputsParams

MIN_TEMPERATURE = 1e-5  # lower temperatures sample greedily
MIN_TOP_P = 1e-7  # smaller top_p keeps just the top token, as this does
# What a request's logprobs report, engine-wide (vLLM's --logprobs-mode; the first is the
# default): see deepinfer.runtime.sampler.
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


@dataclass
class SamplingParams:
    """How to sample one request. Validated on construction; bad values raise
    InvalidParameter (a ValueError naming the field).

    Semantics follow vLLM: `temperature == 0` is greedy; `ignore_eos` keeps generating past EOS
    (EOS can still be sampled); `min_tokens` masks EOS and stop tokens until reached;
    `logprobs=k` returns the sampled token's log-probability and the top-k alternatives;
    `prompt_logprobs=k` the log-probability of every prompt token after the first (given the
    tokens before it) with the top-k alternatives at that position: the log-softmax of the
    model's own logits, never processed (nothing is sampled there).

    Logit processing (vLLM's order, before temperature): `allowed_token_ids` keeps only those
    tokens; `logit_bias` adds to a token's logit; `repetition_penalty` divides a positive
    logit (multiplies a negative one) of every token seen in the prompt or the output;
    `frequency_penalty` subtracts per occurrence in the output and `presence_penalty` once
    per token present in the output (OpenAI's definitions). Applied per sampled position,
    including every verification position of speculative decoding.
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
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's cache_salt: keyed into the first block's prefix hash, so only requests with the
    # same salt share cached prefixes (core.prefix_hash).
    cache_salt: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    # vLLM's bad_words: a word's last token is banned where the output ends with the rest of
    # it. The engine tokenizes the words into `bad_words_token_ids` (`resolve_bad_words`).
    bad_words: list[str] = field(default_factory=list)
    bad_words_token_ids: list[list[int]] | None = None
    # Constrained decoding (JSON schema, regex, choice, EBNF): a grammar masks the logits.
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()} or None
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self.bad_words = list(self.bad_words or [])
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self._validate()
        # Below these the float32 sampler would divide into inf/nan; the results are the same
        # as greedy / keeping only the top token, so map them there (as vLLM does).
        if self.temperature < MIN_TEMPERATURE:
            self.temperature = 0.0
        self.top_p = max(self.top_p, MIN_TOP_P)

    def _validate(self) -> None:
        # (field, holds, message): the field travels with the error (InvalidParameter.param)
        checks = [
            ("n", self.n >= 1, "n must be at least 1"),
            ("temperature", self.temperature >= 0.0, "temperature must be non-negative"),
            ("top_p", 0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            ("top_k", self.top_k >= 0, "top_k must be -1 (disabled) or positive"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1,
             "max_tokens must be at least 1"),
            ("min_tokens", self.min_tokens >= 0, "min_tokens must be non-negative"),
            ("min_tokens", self.max_tokens is None or self.min_tokens <= self.max_tokens,
             "min_tokens must not exceed max_tokens"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20,
             "logprobs must be in [0, 20]"),
            ("prompt_logprobs", self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
             "prompt_logprobs must be in [0, 20]"),
            ("stop", all(isinstance(s, str) and s for s in self.stop),
             "stop must be non-empty strings"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0,
             "presence_penalty must be in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0,
             "frequency_penalty must be in [-2, 2]"),
            ("repetition_penalty", 0.0 < self.repetition_penalty <= 100.0,
             "repetition_penalty must be in (0, 100]"),
            ("logit_bias", all(-100.0 <= v <= 100.0 for v in (self.logit_bias or {}).values()),
             "logit_bias values must be in [-100, 100]"),
            ("logit_bias", all(k >= 0 for k in (self.logit_bias or {})),
             "logit_bias keys must be token ids"),
            ("allowed_token_ids", self.allowed_token_ids is None or (
                len(self.allowed_token_ids) > 0 and all(t >= 0 for t in self.allowed_token_ids)),
             "allowed_token_ids must be a non-empty list of token ids"),
            ("bad_words", all(isinstance(w, str) and w.strip() for w in self.bad_words),
             "bad_words must be non-blank strings"),
            ("cache_salt", self.cache_salt is None or (isinstance(self.cache_salt, str)
                                                       and self.cache_salt != ""),
             "cache_salt must be a non-empty string"),
        ]
        for param, ok, message in checks:
            if not ok:
                raise InvalidParameter(param, message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_history(self) -> bool:
        """Whether sampling reads the tokens before the position (penalties, bad words)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0 or bool(self.bad_words))

    @property
    def needs_history(self) -> bool:
        """Whether the sampler needs the tokens before the position (penalties, and a
        grammar, which it advances over the output)."""
        return self.uses_history or self.structured_outputs is not None

    @property
    def processes_logits(self) -> bool:
        """Whether any of the logit processing above applies (min_tokens aside)."""
        return (self.uses_history or bool(self.logit_bias) or self.allowed_token_ids is not None
                or self.structured_outputs is not None)


def resolve_bad_words(params: SamplingParams, tokenizer) -> SamplingParams:
    """`params` with `bad_words_token_ids` filled as vLLM does: each word's tokens without a
    leading space, and with one when that encodes as a different word of as many tokens (so
    the word is banned at the start of the text and after a space)."""
    if not params.bad_words or params.bad_words_token_ids is not None:
        return params
    ids: list[list[int]] = []
    for word in params.bad_words:
        plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        ids.append(plain)
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            ids.append(spaced)
    return dataclasses.replace(params, bad_words_token_ids=[t for t in ids if t])
