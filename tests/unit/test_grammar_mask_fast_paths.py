"""GrammarMasker's cheap paths on a 6-token vocabulary: rows past the grammar's end get
exactly the stop-token mask without a matcher fill, the host bitmask is reused across steps
(a stale row never leaks into a later step), only structured rows are touched in a batch
mixing them with unstructured ones, and speculative rollback still works through them."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from deepinfer.core.scheduler_output import ScheduledRequest
from deepinfer.engine.step_faults import RequestFault
from deepinfer.runtime.grammar_mask import GrammarMasker
from deepinfer.runtime.sampler import Sampler
from deepinfer.sampling_params import SamplingParams
from tests.unit.test_grammar_mask import A, B, C, EOS, PROMPT, VOCAB, X, allowed, cache, row  # noqa: F401


def plain(request_id: str, output: list[int]) -> ScheduledRequest:
    return ScheduledRequest(request_id, [0], 0, [0], True, SamplingParams(), len(output),
                            eos_token_ids=(EOS,), history_token_ids=PROMPT + output)


def test_rows_past_the_end_get_the_stop_mask_without_a_fill(cache):
    masker = GrammarMasker(cache)
    logits = torch.randn(3, len(VOCAB))
    before = logits.clone()
    masker.apply(logits, [row([A, C, EOS], request_id="p"), row([A], request_id="q"),
                          row([A, C, EOS, EOS], request_id="s")])
    assert masker.num_fills == 1 and masker.num_stop_rows == 2
    for i in (0, 2):  # the stop token keeps its own logit, every other is -inf
        assert logits[i, EOS] == before[i, EOS]
        assert torch.isneginf(logits[i, [t for t in range(len(VOCAB)) if t != EOS]]).all()
    assert set(torch.isfinite(logits[1]).nonzero().flatten().tolist()) == {B, C}


def test_stop_ids_outside_the_logits_are_dropped(cache):
    masker = GrammarMasker(cache)
    r = dataclasses.replace(row([A, C, EOS]), eos_token_ids=(EOS, 99))
    logits = torch.zeros(1, len(VOCAB))
    masker.apply(logits, [r])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [EOS]


def test_the_bitmask_is_reused_and_nothing_stale_leaks(cache):
    masker = GrammarMasker(cache)
    # A wide step, then a narrower one whose rows sit in other grammar states.
    assert allowed(masker, [row([], request_id=f"r{k}") for k in range(4)]) == [{A, 5}] * 4
    assert allowed(masker, [row([A], request_id="r1"), row([A, B], request_id="r2")]) == [
        {B, C}, {B, C}]
    assert allowed(masker, [row([A, C], request_id="r3")]) == [{EOS}]
    assert masker.num_bitmask_allocations == 1


def test_a_batch_mixing_structured_and_plain_rows_masks_only_the_structured(cache):
    """n > 1 children of one prompt, some with a grammar and some without, and a child past
    the grammar's end: plain rows keep every logit."""
    masker = GrammarMasker(cache)
    rows = [plain("p0", [X]), row([A], request_id="s0"), plain("p1", [X, X]),
            row([A, C, EOS], request_id="s1")]
    logits = torch.randn(4, len(VOCAB))
    before = logits.clone()
    masker.apply(logits, rows)
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    assert set(torch.isfinite(logits[1]).nonzero().flatten().tolist()) == {B, C}
    assert torch.isfinite(logits[3]).nonzero().flatten().tolist() == [EOS]


def test_drafts_through_the_end_roll_back(cache):
    """A verification whose drafts close the grammar and run past it, then only the first
    draft accepted: the matcher leaves the past-end state and masks from the grammar again."""
    masker = GrammarMasker(cache)
    assert allowed(masker, [row([A], 3), row([A, C], 3), row([A, C, EOS], 3),
                            row([A, C, EOS, EOS], 3)]) == [{B, C}, {EOS}, {EOS}, {EOS}]
    assert allowed(masker, [row([A, B])]) == [{B, C}]
    assert allowed(masker, [row([A, B, C, EOS])]) == [{EOS}]


def test_an_empty_stop_mask_fails_the_request_in_the_sampler(cache):
    """Past the end with no stop id inside the vocabulary: every token masked, so the
    sampler's check (row maxima) fails that request, and not the plain row beside it."""
    masker = GrammarMasker(cache)
    dead = dataclasses.replace(row([A, C, EOS], request_id="dead"), eos_token_ids=(99,))
    with pytest.raises(RequestFault) as info:
        Sampler.process_logits(torch.randn(2, len(VOCAB)), [plain("ok", [X]), dead], masker)
    assert info.value.request_ids == ["dead"]
