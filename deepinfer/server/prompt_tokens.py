"""Tokenizing a text prompt without paying for text the context could never hold.

A body under the size cap can still carry megabytes of prompt, and the tokenizer takes about
two seconds per megabyte here. A token covers few characters (typical text: ~4), so when
a prefix of `CHARS_PER_TOKEN_BOUND` characters per context token already tokenizes to more
than the context, the whole prompt cannot fit either (the full text's tokens over that prefix
are at least the prefix's, less the one token the cut may merge) and is refused without
tokenizing the rest. Text that tokenizes more densely is tokenized whole, as before.
"""
from __future__ import annotations

from deepinfer.server.errors import bad_request

CHARS_PER_TOKEN_BOUND = 16


def encode_within_context(tokenizer, text: str, max_model_len: int | None,
                          add_special_tokens: bool = True) -> list[int]:
    """`tokenizer.encode(text)`, or a 400 context_length_exceeded decided from a prefix.
    `max_model_len=None` (the caller keeps a prompt's tail, truncate_prompt_tokens): always
    the whole text."""
    if max_model_len is not None and len(text) > max_model_len * CHARS_PER_TOKEN_BOUND:
        head = tokenizer.encode(text[:max_model_len * CHARS_PER_TOKEN_BOUND],
                                add_special_tokens=add_special_tokens)
        if len(head) - 1 >= max_model_len:
            raise bad_request(f"This model's maximum context length is {max_model_len} tokens."
                              f" However, your prompt has more than {len(head) - 1} tokens.",
                              param="prompt", code="context_length_exceeded")
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)
