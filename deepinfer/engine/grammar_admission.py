"""Requests waiting for their structured-output grammar to compile, off the engine loop.

Compiling a grammar against the vocabulary takes ~10 ms for a small schema and seconds for a
large one. Done in `add_request`, one client's large schemas would stall every other stream
for as long; here the spec is checked at once (a bad one is still the caller's error, before
anything is queued), the compile goes to the grammar cache's background thread, and the
request enters the scheduler only when its grammar is ready. A spec already compiled is
admitted at once, as before.
"""
from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

from deepinfer.sampling_params import SamplingParams
from deepinfer.structured.grammars import GrammarCache, build_grammar


@dataclass
class _Held:
    future: Future
    children: list  # core.request.Request, one per sequence (n > 1)


class GrammarAdmission:
    def __init__(self, cache: GrammarCache, background: bool = True) -> None:
        self.cache = cache
        # Off for engines whose steps must stay in lockstep with other ranks (expert
        # parallelism): a rank holding a request back would schedule differently.
        self.background = background
        self._held: dict[str, _Held] = {}

    def __len__(self) -> int:
        return len(self._held)

    def prepare(self, params: SamplingParams) -> Future | None:
        """None when the request can be scheduled now (no grammar, or compiled); else the
        compile's future. InvalidParameter for a spec that cannot be compiled."""
        spec = params.structured_outputs
        if spec is None or self.cache.lookup(spec) is not None:
            return None
        if not self.background:
            self.cache.get(spec)
            return None
        build_grammar(spec)  # vocabulary-free and cheap: a bad spec fails the call itself
        return self.cache.compile_async(spec)

    def hold(self, request_id: str, future: Future, children: list) -> None:
        self._held[request_id] = _Held(future, children)

    def drop(self, request_id: str) -> None:
        self._held.pop(request_id, None)

    def take_ready(self, wait_s: float = 0.0) -> list[tuple[str, list, BaseException | None]]:
        """(request id, its sequences, the compile's error or None) for each compile that
        ended; waits up to `wait_s` for one when none has (an engine with nothing else to
        run would otherwise spin against the compiling thread)."""
        if wait_s > 0 and self._held and not any(h.future.done() for h in self._held.values()):
            wait([h.future for h in self._held.values()], timeout=wait_s,
                 return_when=FIRST_COMPLETED)
        ready = [(rid, held) for rid, held in self._held.items() if held.future.done()]
        for rid, _ in ready:
            del self._held[rid]
        return [(rid, held.children, held.future.exception()) for rid, held in ready]
