"""GrammarMasker on a 6-token vocabulary (no model): the mask follows each row's committed
output, rolls back drafts that were not accepted, masks nothing after a draft the grammar
refuses (that row is discarded by the verification), and fails the request whose output the
grammar refuses."""
from __future__ import annotations

import llguidance
import pytest
import torch
import xgrammar as xgr

from deepinfer.core.scheduler_output import ScheduledRequest
from deepinfer.core.request_fault import RequestFault
from deepinfer.runtime.grammar_mask import GrammarMasker
from deepinfer.sampling_params import SamplingParams
from deepinfer.structured import llguidance_grammar
from deepinfer.structured.grammars import CompiledGrammar, build_grammar
from deepinfer.structured.params import StructuredOutputsParams

VOCAB = ["a", "b", "c", "x", "<eos>", "ab"]
A, B, C, X, EOS, AB = range(6)
PROMPT = [X, X]


class SmallCache:
    def __init__(self) -> None:
        info = xgr.TokenizerInfo(VOCAB, stop_token_ids=[EOS])
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def get(self, spec):
        built = build_grammar(spec)
        assert built.backend == "xgrammar"
        return CompiledGrammar("xgrammar", self.compiler.compile_grammar(built.grammar))


class _SmallTokenizer:
    """What llguidance needs of a tokenizer: each id's bytes and an encoder."""
    eos_token_id, bos_token_id, special_token_ids = EOS, None, [EOS]
    tokens = [t.encode() for t in VOCAB]

    def __call__(self, text):
        text = text.decode() if isinstance(text, bytes) else text
        ids, i = [], 0
        while i < len(text):
            ids.append(AB if text.startswith("ab", i) else VOCAB.index(text[i]))
            i += 2 if ids[-1] == AB else 1
        return ids


class SmallLLGuidanceCache:
    def __init__(self) -> None:
        self.tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_SmallTokenizer()),
                                                n_vocab=len(VOCAB), eos_token=[EOS])

    def get(self, spec):
        return CompiledGrammar("llguidance", llguidance_grammar.LLGuidanceMatcher(
            self.tokenizer, llguidance_grammar.regex_grammar(spec.regex)))


@pytest.fixture(params=[SmallCache, SmallLLGuidanceCache], ids=["xgrammar", "llguidance"])
def cache(request):
    return request.param()


SPEC = StructuredOutputsParams(regex="ab*c")


def row(output: list[int], drafts: int = 0, request_id: str = "r") -> ScheduledRequest:
    return ScheduledRequest(request_id, [0], 0, [0], True,
                            SamplingParams(structured_outputs=SPEC), len(output),
                            eos_token_ids=(EOS,), num_draft_tokens=drafts,
                            history_token_ids=PROMPT + output)


def allowed(masker: GrammarMasker, rows: list[ScheduledRequest]) -> list[set[int]]:
    logits = torch.zeros(len(rows), len(VOCAB))
    masker.apply(logits, rows)
    return [set(torch.isfinite(r).nonzero().flatten().tolist()) for r in logits]


def test_mask_follows_the_output_and_rolls_back(cache):
    masker = GrammarMasker(cache)
    assert allowed(masker, [row([])]) == [{A, AB}]
    assert allowed(masker, [row([A])]) == [{B, C}]
    # A verification of drafts [B, C]: rows after [], [B], [B, C].
    assert allowed(masker, [row([A], 2), row([A, B], 2), row([A, B, C], 2)]) == [
        {B, C}, {B, C}, {EOS}]
    # Only B was accepted, then the target sampled B: the matcher rolls back C.
    assert allowed(masker, [row([A, B, B])]) == [{B, C}]
    # A draft the grammar refuses: rows after it are left unmasked.
    assert allowed(masker, [row([A, B, B], 1), row([A, B, B, X], 1)]) == [{B, C}, set(range(6))]
    assert allowed(masker, [row([A, B, B, C])]) == [{EOS}]
    # A different request, and a rebuilt one after forget, start from the grammar's start.
    assert allowed(masker, [row([], request_id="other"), row([A, B, B, C])]) == [{A, AB}, {EOS}]
    masker.forget(["r", "other"])
    assert len(masker) == 0
    assert allowed(masker, [row([AB])]) == [{B, C}]  # replayed from the output


def test_output_the_grammar_refuses_fails_that_request(cache):
    masker = GrammarMasker(cache)
    with pytest.raises(RequestFault) as info:
        allowed(masker, [row([X], request_id="bad")])
    assert info.value.request_ids == ["bad"] and "not allowed" in str(info.value)


def test_a_stop_token_ends_the_grammar_and_is_rolled_back_like_any_token(cache):
    masker = GrammarMasker(cache)
    assert allowed(masker, [row([A, C])]) == [{EOS}]
    assert allowed(masker, [row([A, C, EOS])]) == [{EOS}]  # past the end: stop tokens only
    assert allowed(masker, [row([A, C])]) == [{EOS}]  # the stop token undone
    assert allowed(masker, [row([A])]) == [{B, C}]


def test_stop_tokens_past_the_end_are_taken_and_undone(cache):
    """ignore_eos keeps sampling after the grammar's end: only stop tokens, and they are
    neither a fault nor given to the matcher (which accepts nothing once terminated)."""
    masker = GrammarMasker(cache)
    assert allowed(masker, [row([A, C, EOS, EOS, EOS])]) == [{EOS}]
    assert allowed(masker, [row([A, C, EOS])]) == [{EOS}]  # two of them undone
    assert allowed(masker, [row([A])]) == [{B, C}]  # and through the end into the grammar
    with pytest.raises(RequestFault):
        allowed(masker, [row([A, C, EOS, A], request_id="late")])
