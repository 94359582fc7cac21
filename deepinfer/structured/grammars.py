"""Grammars for structured outputs, on xgrammar.

`build_grammar` turns a StructuredOutputsParams into an xgrammar Grammar without a tokenizer
(cheap: the front door calls it to answer a bad spec with a 400 before anything is queued).
`GrammarCache` compiles grammars against one tokenizer's vocabulary, once per spec.

JSON is generated compact (no free whitespace between tokens: a small model left free to emit
whitespace can loop on it until max_tokens) and in xgrammar's strict mode (objects take no
properties beyond those the schema names), which only narrows the outputs the schema admits.
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict

import xgrammar as xgr

from deepinfer.sampling_params import InvalidParameter
from deepinfer.structured.params import StructuredOutputsParams

_JSON_OPTIONS = {"any_whitespace": False}
_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


def build_grammar(spec: StructuredOutputsParams) -> xgr.Grammar:
    """The spec's grammar; InvalidParameter("structured_outputs") naming what is wrong."""
    kind = spec.kind
    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(spec.json, strict_mode=True, **_JSON_OPTIONS)
        if kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', strict_mode=False,
                                                **_JSON_OPTIONS)
        if kind == "regex":
            return xgr.Grammar.from_regex(spec.regex)
        if kind == "choice":
            # JSON string literals are valid EBNF literals (same escapes).
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in spec.choice))
        return xgr.Grammar.from_ebnf(spec.grammar)
    except (RuntimeError, ValueError, TypeError) as e:
        raise InvalidParameter("structured_outputs",
                               f"cannot compile the {kind} constraint: {_short(e)}") from None


def _short(e: Exception) -> str:
    """xgrammar's message without its "[time] file.cc:line:" prefix."""
    text = _SOURCE_PREFIX.sub("", str(e).strip())
    return text.splitlines()[0][:500] if text else type(e).__name__


class GrammarCache:
    """Compiled grammars for one vocabulary, least recently used dropped past `max_entries`.
    Thread-safe (compiles may run off the engine loop)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int],
                 max_entries: int = 256, max_threads: int = 1) -> None:
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._stop_token_ids = list(stop_token_ids)
        self._max_threads = max_threads
        self._compiler: xgr.GrammarCompiler | None = None  # built on first use (~0.3 s)
        self._compiled: OrderedDict[tuple, xgr.CompiledGrammar] = OrderedDict()
        self._max_entries = max_entries
        self._lock = threading.Lock()
        self.num_compiles = 0

    def get(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        key = spec.key()
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
                return compiled
        grammar = build_grammar(spec)
        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stop_token_ids)
                # xgrammar can cache too; ours is keyed by the spec (a schema's canonical text)
                self._compiler = xgr.GrammarCompiler(info, max_threads=self._max_threads,
                                                     cache_enabled=False)
        compiled = self._compiler.compile_grammar(grammar)
        with self._lock:
            self.num_compiles += 1
            self._compiled[key] = compiled
            while len(self._compiled) > self._max_entries:
                self._compiled.popitem(last=False)
        return compiled
