"""Incremental detokenization and stop-string detection for one output sequence.

Decoding only a short window (prefix_offset..end) per step keeps the cost O(1) per token;
a few prompt tokens seed the window so the first output token keeps its leading space with
SentencePiece-style tokenizers. A window ending in U+FFFD is an incomplete UTF-8 sequence:
wait for the next token, unless the sequence ends here, when the window is flushed as it
decodes (so the final text is the decode of every output token, as in vLLM).
"""
from __future__ import annotations

from deepinfer.sampling_params import SamplingParams

_PROMPT_CONTEXT = 5


def window_decoder(tokenizer):
    """`decode(ids, skip_special_tokens)` for the detokenizer's windows. A transformers fast
    tokenizer that does no clean-up decodes with its `tokenizers.Tokenizer` directly: that is
    all its `decode` does then, after converting the input element by element (`to_py_obj`,
    most of the cost: ~60% of the detokenizer's per-token time at batch 64). Any other
    tokenizer (or a subclass with its own `_decode`) goes through its `decode`."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout
        TokenizersBackend = None
    backend = getattr(tokenizer, "_tokenizer", None)
    if (TokenizersBackend is not None and isinstance(tokenizer, TokenizersBackend)
            and type(tokenizer)._decode is TokenizersBackend._decode
            and type(tokenizer).decode is TokenizersBackend.decode
            and not getattr(tokenizer, "clean_up_tokenization_spaces", True)
            and hasattr(backend, "decode")):
        return lambda ids, skip_special_tokens: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids, skip_special_tokens: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 stop: list[str] | None = None, include_stop_str_in_output: bool = False,
                 min_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self._decode = window_decoder(tokenizer)
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._ids = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.text = ""
        self.stop = stop or []
        self.include_stop = include_stop_str_in_output
        self.min_tokens = min_tokens  # stop strings end nothing before this many tokens (vLLM)
        self.num_output_tokens = 0
        self.stopped = False  # a stop string cut the text: nothing more is appended

    @classmethod
    def for_request(cls, tokenizer, prompt_token_ids: list[int],
                    params: SamplingParams) -> IncrementalDetokenizer:
        return cls(tokenizer, prompt_token_ids, params.skip_special_tokens, params.stop,
                   params.include_stop_str_in_output, params.min_tokens)

    def add_tokens(self, token_ids: list[int], final: bool = False,
                   stop_token: bool = False) -> str | None:
        """Append output tokens; return the stop string if one now appears in the text (the
        text is then cut at it), else None. `final`: the sequence ends with these tokens, so
        text held back for an incomplete character is flushed. `stop_token`: the last token is
        the EOS / stop token that ended the sequence; as in vLLM its text is left out unless
        include_stop_str_in_output."""
        if self.stopped:
            return None
        self.num_output_tokens += len(token_ids)
        if stop_token and not self.include_stop:
            token_ids = token_ids[:-1]
        self._ids.extend(token_ids)
        decode = self._decode
        prefix = decode(self._ids[self._prefix_offset:self._read_offset],
                        skip_special_tokens=self.skip_special_tokens)
        full = decode(self._ids[self._prefix_offset:], skip_special_tokens=self.skip_special_tokens)
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not (final or stop_token)):
            return None
        old_len = len(self.text)
        self.text += full[len(prefix):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        if self.num_output_tokens < self.min_tokens:
            return None
        return self._check_stop(old_len)

    def _check_stop(self, old_len: int) -> str | None:
        if not self.stop:
            return None
        # A stop string may straddle the old/new boundary, but must end in the new text (one
        # wholly in the old text was seen before min_tokens and ignored).
        best = None
        for stop in self.stop:
            idx = self.text.find(stop, max(0, old_len - len(stop) + 1))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        idx, stop = best
        self.text = self.text[:idx + len(stop)] if self.include_stop else self.text[:idx]
        self.stopped = True
        return stop
