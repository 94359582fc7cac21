"""What the engine checks of a request before it queues anything: the prompt's ids and
length, every token id a sampling option will index with, and max_tokens against the context
(a ValueError / InvalidParameter naming the field; nothing is recorded)."""
from __future__ import annotations

import dataclasses

from deepinfer.invalid_parameter import InvalidParameter

from deepinfer.sampling_params import SamplingParams


def check_prompt(prompt_token_ids: list[int], vocab_size: int, max_model_len: int) -> list[int]:
    ids = list(prompt_token_ids)
    if not ids:
        raise ValueError("the prompt is empty")
    if any(not isinstance(t, int) or t < 0 or t >= vocab_size for t in ids):
        raise ValueError(f"prompt token ids must be integers in [0, {vocab_size})")
    if len(ids) >= max_model_len:
        raise ValueError(f"the prompt has {len(ids)} tokens, but this model's maximum context "
                         f"length is {max_model_len} tokens")
    return ids


def check_token_ids(params: SamplingParams, vocab_size: int, eos_token_ids) -> None:
    # min_tokens masks these ids in the logits: an id outside the vocabulary would crash
    # the whole engine step, not just this request.
    if any(not isinstance(t, int) or t < 0 or t >= vocab_size for t in params.stop_token_ids):
        raise InvalidParameter("stop_token_ids",
                               f"stop_token_ids must be integers in [0, {vocab_size})")
    # Likewise the ids logit_bias and allowed_token_ids index.
    for name, ids in (("logit_bias", params.logit_bias or {}),
                      ("allowed_token_ids", params.allowed_token_ids or []),
                      ("bad_words", [t for w in params.bad_words_token_ids or [] for t in w])):
        if any(not isinstance(t, int) or t < 0 or t >= vocab_size for t in ids):
            raise InvalidParameter(name, f"{name} token ids must be integers in [0, {vocab_size})")
    # Before min_tokens, EOS and stop ids are masked: allowed ids among them only would
    # leave every logit -inf and sample an arbitrary (disallowed) token.
    if params.min_tokens > 0 and params.allowed_token_ids is not None and set(
            params.allowed_token_ids) <= set(eos_token_ids) | set(params.stop_token_ids):
        raise InvalidParameter("allowed_token_ids", "allowed_token_ids leaves no token to "
                               "sample before min_tokens (every allowed id is EOS or a stop "
                               "token id)")


def resolve_max_tokens(params: SamplingParams, num_prompt: int,
                       max_model_len: int) -> SamplingParams:
    room = max_model_len - num_prompt
    if params.max_tokens is None:
        return dataclasses.replace(params, max_tokens=room)
    if params.max_tokens > room:
        raise InvalidParameter("max_tokens", f"prompt ({num_prompt} tokens) + max_tokens "
                               f"({params.max_tokens}) exceeds this model's maximum "
                               f"context length of {max_model_len}")
    return params
