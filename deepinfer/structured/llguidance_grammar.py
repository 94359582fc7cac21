"""The llguidance side of structured outputs: grammars xgrammar cannot compile or would not
enforce (structured/schema_features.py), and a matcher with xgrammar's matcher's methods so
the sampler's masker (runtime/grammar_mask.py) drives either.

llguidance's token bitmask has xgrammar's layout (int32 words, bit set = allowed), so rows of
both kinds fill one bitmask and are applied in one call.
"""
from __future__ import annotations

import llguidance
import llguidance.hf
import llguidance.torch
from torch import Tensor

# The same compact JSON as the xgrammar path: one space after ',' and ':', nowhere else.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_grammar(schema_text: str) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(schema_text, defaults=_JSON_OPTIONS)


def regex_grammar(regex: str) -> str:
    return llguidance.LLMatcher.grammar_from_regex(regex)


def grammar_problem(grammar: str) -> str | None:
    """Why llguidance cannot honour `grammar` in full (an error, or a warning such as
    'Unimplemented keys: ["not"]': it would otherwise drop that part), or None."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error or messages:
        return "; ".join(_one_line(m) for m in messages) or "invalid grammar"
    return None


def _one_line(message: str) -> str:
    """A multi-line parser message (text, the source, a ^^^ marker, the reason) on one line."""
    lines = (line.strip() for line in message.splitlines())
    return " ".join(line for line in lines if line and set(line) != {"^"})


def tokenizer_for(hf_tokenizer, vocab_size: int, stop_token_ids: list[int]):
    """llguidance's view of the vocabulary (~1 s: built once per engine, on first use)."""
    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size,
                                        eos_token=list(stop_token_ids))


class LLGuidanceMatcher:
    """GrammarMatcher's accept_token / rollback / fill_next_token_bitmask / is_terminated, with
    its meaning: a stop token taken where the grammar may end terminates the matcher (nothing
    is accepted after it) and is one token for rollback.

    llguidance itself does not count a stop token taken once its grammar is complete, and it
    enters an error state it never leaves on a refused token, while a refused speculative
    draft must leave the matcher as it was: so stop tokens are handled here, and other tokens
    are checked before they are consumed."""

    def __init__(self, tokenizer, grammar: str) -> None:
        self._matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if self._matcher.is_error():
            raise ValueError(self._matcher.get_error())
        self._stop_ids = frozenset(tokenizer.eos_tokens)
        self._terminated = False

    def copy(self) -> LLGuidanceMatcher:
        """An independent matcher in this one's state (no recompile)."""
        twin = object.__new__(LLGuidanceMatcher)
        twin._matcher = self._matcher.deep_copy()
        twin._stop_ids, twin._terminated = self._stop_ids, self._terminated
        return twin

    def accept_token(self, token: int) -> bool:
        if self._terminated:
            return False
        if token in self._stop_ids:
            self._terminated = self._matcher.is_accepting()
            return self._terminated
        if self._matcher.validate_tokens([token]) != 1:
            return False
        return self._matcher.consume_token(token)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and self._terminated:
            self._terminated = False
            num_tokens -= 1
        if num_tokens:
            self._matcher.rollback(num_tokens)

    def fill_next_token_bitmask(self, bitmask: Tensor, index: int) -> None:
        llguidance.torch.fill_next_token_bitmask(self._matcher, bitmask, index)

    def is_terminated(self) -> bool:
        return self._terminated
