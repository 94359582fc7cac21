"""Fill-in-the-middle prompts for /v1/completions `suffix`.

A model family writes FIM with its own three tokens, prefix-suffix-middle order:
    <prefix token> prefix text <suffix token> suffix text <middle token>   -> the model writes the middle
The family is recognised by its tokens being single tokens of the vocabulary; a tokenizer
with none of these has no FIM, and `suffix` is then a 400 naming why.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FimTokens:
    family: str
    prefix: str
    suffix: str
    middle: str


FIM_FAMILIES = (
    FimTokens("starcoder", "<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # also SmolLM
    FimTokens("qwen2.5-coder", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    FimTokens("deepseek-coder", "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
)


def fim_tokens(tokenizer) -> FimTokens | None:
    """The FIM family of this tokenizer's vocabulary (the first that matches), or None."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    for family in FIM_FAMILIES:
        if all(t in vocab for t in (family.prefix, family.suffix, family.middle)):
            return family
    return None


def fim_prompt(tokenizer, prefix: str, suffix: str, add_special_tokens: bool = True) -> list[int]:
    """The FIM prompt's token ids; ValueError when the tokenizer has no FIM tokens. The texts
    are tokenized on their own, so neither can run into the markers."""
    family = fim_tokens(tokenizer)
    if family is None:
        raise ValueError("suffix (fill-in-the-middle) needs a model whose tokenizer has FIM "
                         "tokens (e.g. <fim_prefix> <fim_suffix> <fim_middle>); this model's has "
                         "none")
    vocab = tokenizer.get_vocab()
    leading = tokenizer.encode("", add_special_tokens=True) if add_special_tokens else []
    return (list(leading) + [vocab[family.prefix]]
            + tokenizer.encode(prefix, add_special_tokens=False) + [vocab[family.suffix]]
            + tokenizer.encode(suffix, add_special_tokens=False) + [vocab[family.middle]])
