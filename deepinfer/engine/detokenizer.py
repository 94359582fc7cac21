"""Incremental detokenization and stop-string detection for one output sequence.

Decoding only a short window (prefix_offset..end) per step keeps the cost O(1) per token;
a few prompt tokens seed the window so the first output token keeps its leading space with
SentencePiece-style tokenizers. A window ending in U+FFFD is an incomplete UTF-8 sequence:
wait for the next token.
"""
from __future__ import annotations

_PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 stop: list[str] | None = None, include_stop_str_in_output: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._ids = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.text = ""
        self.stop = stop or []
        self.include_stop = include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self.stop), default=0)

    def add_tokens(self, token_ids: list[int]) -> str | None:
        """Append tokens; return the stop string if one now appears in the text (the text is
        then cut at it), else None."""
        self._ids.extend(token_ids)
        decode = self.tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset:self._read_offset],
                        skip_special_tokens=self.skip_special_tokens)
        full = decode(self._ids[self._prefix_offset:], skip_special_tokens=self.skip_special_tokens)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None
        old_len = len(self.text)
        self.text += full[len(prefix):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return self._check_stop(old_len)

    def _check_stop(self, old_len: int) -> str | None:
        if not self.stop:
            return None
        # A stop string may straddle the old/new boundary.
        start = max(0, old_len - self._max_stop_len + 1)
        best = None
        for stop in self.stop:
            idx = self.text.find(stop, start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        idx, stop = best
        self.text = self.text[:idx + len(stop)] if self.include_stop else self.text[:idx]
        return stop
