"""Grammars for structured outputs, on xgrammar.

`build_grammar` turns a StructuredOutputsParams into an xgrammar Grammar without a tokenizer
(cheap: the front door calls it to answer a bad spec with a 400 before anything is queued).
`GrammarCache` compiles grammars against one tokenizer's vocabulary, once per spec.

JSON is generated compact (no free whitespace between tokens: a small model left free to emit
whitespace can loop on it until max_tokens) and in xgrammar's strict mode (objects take no
properties beyond those the schema names), which only narrows the outputs the schema admits.

A structural tag (structured/structural_tag.py) is built by xgrammar's structural-tag API;
its JSON inside `begin`..`end` follows that format's own whitespace setting.

A JSON schema or regex xgrammar would not enforce in full (structured/schema_features.py), or
a JSON schema it cannot compile, goes to llguidance (structured/llguidance_grammar.py); what
neither library can honour is an InvalidParameter naming the feature, never a looser output.
On the llguidance path objects follow JSON Schema itself (extra properties only where the
schema allows them), since forcing xgrammar's strict mode into each branch of an `allOf`
would make most of them unsatisfiable.
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import xgrammar as xgr

from deepinfer.invalid_parameter import InvalidParameter
from deepinfer.structured import llguidance_grammar as llg
from deepinfer.structured.params import StructuredOutputsParams
from deepinfer.structured.schema_features import has_lookaround, unenforced_by_xgrammar
from deepinfer.structured.structural_tag_checks import structural_tag_problem

_JSON_OPTIONS = {"any_whitespace": False}
_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


@dataclass(frozen=True)
class BuiltGrammar:
    backend: str  # "xgrammar" (grammar: xgr.Grammar) or "llguidance" (grammar: its JSON text)
    grammar: Any


def build_grammar(spec: StructuredOutputsParams) -> BuiltGrammar:
    """The spec's grammar; InvalidParameter("structured_outputs") naming what is wrong."""
    kind = spec.kind
    if kind == "json":
        unenforced = unenforced_by_xgrammar(json.loads(spec.json))
        if unenforced:
            return _llguidance(kind, llg.json_grammar(spec.json), ", ".join(unenforced))
    if kind == "structural_tag":
        problem = structural_tag_problem(spec.structural_tag)
        if problem is not None:
            raise InvalidParameter("structured_outputs", problem)
    if kind == "regex" and has_lookaround(spec.regex):
        return _llguidance(kind, llg.regex_grammar(spec.regex), "look-around")
    try:
        return BuiltGrammar("xgrammar", _xgrammar(spec))
    except (RuntimeError, ValueError, TypeError) as e:
        if kind == "json":
            grammar = llg.json_grammar(spec.json)
            if llg.grammar_problem(grammar) is None:
                return BuiltGrammar("llguidance", grammar)
        raise InvalidParameter("structured_outputs",
                               f"cannot compile the {kind} constraint: {_short(e)}") from None


def _xgrammar(spec: StructuredOutputsParams) -> xgr.Grammar:
    kind = spec.kind
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
    if kind == "structural_tag":
        return xgr.Grammar.from_structural_tag(spec.structural_tag)
    return xgr.Grammar.from_ebnf(spec.grammar)


def _llguidance(kind: str, grammar: str, features: str) -> BuiltGrammar:
    problem = llg.grammar_problem(grammar)
    if problem is not None:
        raise InvalidParameter("structured_outputs", f"cannot enforce the {kind} constraint "
                               f"({features}): {problem[:500]}")
    return BuiltGrammar("llguidance", grammar)


def _short(e: Exception) -> str:
    """xgrammar's message without its "[time] file.cc:line:" prefix."""
    text = _SOURCE_PREFIX.sub("", str(e).strip())
    return text.splitlines()[0][:500] if text else type(e).__name__


class CompiledGrammar:
    """One spec compiled for one vocabulary; `matcher()` starts a request's matcher.
    `compiled`: xgrammar's CompiledGrammar, or a fresh LLGuidanceMatcher (llguidance compiles
    when a matcher is built, so the cache holds one built matcher and copies it)."""

    def __init__(self, backend: str, compiled) -> None:
        self.backend = backend
        self._compiled = compiled

    def matcher(self):
        if self.backend == "xgrammar":
            return xgr.GrammarMatcher(self._compiled)  # rollback is unlimited
        return self._compiled.copy()


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
        self._llg_tokenizer = None  # likewise (~1 s)
        self._compiled: OrderedDict[tuple, CompiledGrammar] = OrderedDict()
        self._max_entries = max_entries
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None  # background compiles (one at a time)
        self._compiling: dict[tuple, Future] = {}
        self.num_compiles = 0

    def lookup(self, spec: StructuredOutputsParams) -> CompiledGrammar | None:
        """The compiled grammar if it is cached, else None (never compiles)."""
        with self._lock:
            return self._compiled.get(spec.key())

    def compile_async(self, spec: StructuredOutputsParams) -> Future:
        """`get(spec)` on a background thread (one at a time: a burst of distinct schemas
        queues instead of taking every core); requests for a spec in flight share it."""
        key = spec.key()
        with self._lock:
            future = self._compiling.get(key)
            if future is not None:
                return future
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
            future = self._pool.submit(self.get, spec)
            self._compiling[key] = future
        future.add_done_callback(lambda _: self._compile_done(key))
        return future

    def _compile_done(self, key: tuple) -> None:
        with self._lock:
            self._compiling.pop(key, None)

    def get(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        key = spec.key()
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
                return compiled
        built = build_grammar(spec)
        if built.backend == "xgrammar":
            compiled = CompiledGrammar("xgrammar", self._xgrammar_compiler().compile_grammar(
                built.grammar))
        else:
            compiled = CompiledGrammar("llguidance", llg.LLGuidanceMatcher(
                self._llguidance_tokenizer(), built.grammar))
        with self._lock:
            self.num_compiles += 1
            self._compiled[key] = compiled
            while len(self._compiled) > self._max_entries:
                self._compiled.popitem(last=False)
        return compiled

    def _xgrammar_compiler(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stop_token_ids)
                # xgrammar can cache too; ours is keyed by the spec (a schema's canonical text)
                self._compiler = xgr.GrammarCompiler(info, max_threads=self._max_threads,
                                                     cache_enabled=False)
            return self._compiler

    def _llguidance_tokenizer(self):
        with self._lock:
            if self._llg_tokenizer is None:
                try:
                    self._llg_tokenizer = llg.tokenizer_for(self._tokenizer, self.vocab_size,
                                                            self._stop_token_ids)
                except ValueError as e:  # a slow (non-Rust) tokenizer
                    raise InvalidParameter("structured_outputs", "this schema needs llguidance, "
                                           f"which cannot read this model's tokenizer: {e}") from None
            return self._llg_tokenizer
