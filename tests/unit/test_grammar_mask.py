"""GrammarMasker on a 6-token vocabulary (no model): the mask follows each row's committed
output, rolls back drafts that were not accepted, masks nothing after a draft the grammar
refuses (that row is discarded by the verification), and fails the request whose output the
grammar refuses."""
from __future__ import annotations

import pytest
import torch
import xgrammar as xgr

from deepinfer.core.scheduler_output import ScheduledRequest
from deepinfer.engine.step_faults import RequestFault
from deepinfer.runtime.grammar_mask import GrammarMasker
from deepinfer.sampling_params import SamplingParams
from deepinfer.structured.grammars import build_grammar
from deepinfer.structured.params import StructuredOutputsParams

VOCAB = ["a", "b", "c", "x", "<eos>", "ab"]
A, B, C, X, EOS, AB = range(6)
PROMPT = [X, X]


class SmallCache:
    def __init__(self) -> None:
        info = xgr.TokenizerInfo(VOCAB, stop_token_ids=[EOS])
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def get(self, spec):
        return self.compiler.compile_grammar(build_grammar(spec))


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


def test_mask_follows_the_output_and_rolls_back():
    masker = GrammarMasker(SmallCache())
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


def test_output_the_grammar_refuses_fails_that_request():
    masker = GrammarMasker(SmallCache())
    with pytest.raises(RequestFault) as info:
        allowed(masker, [row([X], request_id="bad")])
    assert info.value.request_ids == ["bad"] and "not allowed" in str(info.value)
