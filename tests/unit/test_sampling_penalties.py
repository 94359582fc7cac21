"""Logit processing (penalties, logit_bias, allowed_token_ids) against plain-torch references
written from vLLM's / OpenAI's definitions, per sampled position."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from deepinfer.core.scheduler_output import ScheduledRequest
from deepinfer.runtime.sampler import Sampler
from deepinfer.sampling_params import SamplingParams, resolve_bad_words
from deepinfer.spec.verifier import SpecVerifier

V = 50


def row(params: SamplingParams, prompt: list[int], output: list[int], rid: str = "r"
        ) -> ScheduledRequest:
    return ScheduledRequest(rid, [(prompt + output)[-1]], len(prompt + output) - 1, [0], True,
                            params, len(output),
                            history_token_ids=list(prompt + output) if params.uses_history else None)


def reference(logits: torch.Tensor, params: SamplingParams, prompt: list[int],
              output: list[int]) -> torch.Tensor:
    """Token by token, in vLLM's order."""
    out = logits.clone()
    if params.allowed_token_ids is not None:
        for t in range(V):
            if t not in params.allowed_token_ids:
                out[t] = float("-inf")
    for t, b in (params.logit_bias or {}).items():
        out[t] += b
    for t in range(V):
        if t in prompt or t in output:
            p = params.repetition_penalty
            out[t] = out[t] / p if out[t] > 0 else out[t] * p
        count = output.count(t)
        out[t] -= params.frequency_penalty * count
        out[t] -= params.presence_penalty * (count > 0)
    return out


CASES = [
    SamplingParams(temperature=0.0, presence_penalty=1.5),
    SamplingParams(temperature=0.0, frequency_penalty=-0.7),
    SamplingParams(temperature=0.7, repetition_penalty=1.3),
    SamplingParams(temperature=0.0, repetition_penalty=0.8, frequency_penalty=0.4,
                   presence_penalty=-0.3, logit_bias={3: 5.0, 7: -100.0}),
    SamplingParams(temperature=0.0, allowed_token_ids=[1, 4, 9, 30], logit_bias={4: 2.0}),
]


@pytest.mark.parametrize("params", CASES)
def test_processing_matches_the_reference(params):
    g = torch.Generator().manual_seed(0)
    prompt, output = [1, 2, 2, 9, 40], [9, 9, 3, 4, 4, 4]
    logits = torch.randn(2, V, generator=g) * 3
    rows = [row(params, prompt, output), row(SamplingParams(temperature=0.0), prompt, output)]
    expected = [reference(logits[0], params, prompt, output), logits[1].clone()]
    Sampler.process_logits(logits, rows)
    torch.testing.assert_close(logits[0], expected[0])
    torch.testing.assert_close(logits[1], expected[1])  # plain rows untouched


def test_penalised_greedy_token_changes():
    """An ignored penalty would still pick the repeated token."""
    logits = torch.zeros(1, V)
    logits[0, 5], logits[0, 6] = 2.0, 1.5
    params = SamplingParams(temperature=0.0, presence_penalty=1.0)
    tokens, _ = Sampler(torch.device("cpu")).sample(logits, [row(params, [1], [5])])
    assert tokens == [6]


class _NoDrafter:
    def take_draft_probs(self, request_id, draft_token_ids):
        return None


@pytest.mark.parametrize("drafts,emitted", [([7, 7, 8], [7, 7, 8, 7]), ([7, 8, 8], [7, 7])])
def test_verification_rows_count_the_drafts_before_them(drafts, emitted):
    """Row j of a verification sees the prompt, the output and drafts [:j]: a greedy request
    with a frequency penalty emits exactly what plain decoding gives. Logits: 7 at 10, 8 at 6,
    so with the penalty plain decoding gives 7, 7 (10 - 2.5), 8 (7 at 10 - 4.5), 7."""
    params = SamplingParams(temperature=0.0, frequency_penalty=2.0, presence_penalty=0.5)
    prompt = [1, 2, 3]
    base = torch.zeros(V)
    base[7], base[8] = 10.0, 6.0

    plain, seen = [], []
    for _ in range(len(drafts) + 1):
        tok, _ = Sampler(torch.device("cpu")).sample(base.clone().unsqueeze(0),
                                                     [row(params, prompt, seen)])
        plain.append(tok[0])
        seen.append(tok[0])
    assert plain == [7, 7, 8, 7]

    r = ScheduledRequest("r", [prompt[-1]] + drafts, len(prompt) - 1, [0], True, params, 0,
                         num_draft_tokens=len(drafts), history_token_ids=list(prompt))

    class _Model:
        @staticmethod
        def compute_logits(h):
            return base.repeat(h.shape[0], 1)

    verifier = SpecVerifier(Sampler(torch.device("cpu")), _NoDrafter())
    result = verifier.sample(_Model(), torch.zeros(len(drafts) + 1, 8), [r])
    assert result.verified_token_ids["r"] == emitted == plain[:len(emitted)]


def test_params_validate():
    for bad in (dict(presence_penalty=2.5), dict(frequency_penalty=float("nan")),
                dict(repetition_penalty=0.0), dict(logit_bias={1: 101.0}),
                dict(allowed_token_ids=[]), dict(logit_bias={-1: 1.0})):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    p = SamplingParams(logit_bias={"3": 1}, allowed_token_ids=(1, 2))
    assert p.logit_bias == {3: 1.0} and p.allowed_token_ids == [1, 2]


def test_params_cross_the_engine_wire():
    from deepinfer.wire.engine_messages import AddRequest, make_encoder
    import msgspec
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.1,
                       logit_bias={3: 1.5}, allowed_token_ids=[3, 4], bad_words=["a b"],
                       bad_words_token_ids=[[5, 6]])
    msg = AddRequest("x", [1], p, 0.0)
    back = msgspec.msgpack.decode(make_encoder().encode(msg), type=AddRequest)
    assert dataclasses.asdict(back.sampling_params) == dataclasses.asdict(p)


class WordTokenizer:
    """Words (with their leading space) are tokens: "red" 20, " red" 21, "blue" 22, " blue"
    23, " sky" 24, "sky" 25."""
    VOCAB = {"red": 20, " red": 21, "blue": 22, " blue": 23, " sky": 24, "sky": 25}

    def encode(self, text, add_special_tokens=True):
        import re
        return [self.VOCAB[w] for w in re.findall(r" ?\S+", text)]


def test_bad_words_are_tokenized_with_and_without_a_space():
    params = resolve_bad_words(SamplingParams(bad_words=["red", " blue sky"]), WordTokenizer())
    assert params.bad_words_token_ids == [[20], [21], [22, 24], [23, 24]]


@pytest.mark.parametrize("output,banned", [
    ([], {20, 21}), ([5], {20, 21}), ([5, 22], {20, 21, 24}), ([23], {20, 21, 24}),
    ([22, 5], {20, 21})])
def test_bad_words_ban_the_last_token_after_the_rest(output, banned):
    """vLLM: a word's last token is banned where the output ends with the word's other tokens
    (the prompt does not count)."""
    params = resolve_bad_words(SamplingParams(temperature=0.0, bad_words=["red", "blue sky"]),
                               WordTokenizer())
    logits = torch.zeros(1, V)
    Sampler.process_logits(logits, [row(params, [22], output)])  # prompt ends with "blue"
    assert set(torch.nonzero(logits[0] == float("-inf")).flatten().tolist()) == banned


def test_unresolved_bad_words_are_an_error_not_ignored():
    with pytest.raises(ValueError, match="bad_words"):
        Sampler.process_logits(torch.zeros(1, V), [row(SamplingParams(bad_words=["x"]), [1], [])])


def test_a_row_whose_options_mask_every_token_fails_that_request_not_token_0():
    """allowed_token_ids all banned by bad_words: before, argmax of an all -inf row gave
    token 0 (excluded by the request) with no error."""
    from deepinfer.core.request_fault import RequestFault

    banned = SamplingParams(temperature=0.0, allowed_token_ids=[5, 6],
                            bad_words=["x", "y"], bad_words_token_ids=[[5], [6]])
    ok = SamplingParams(temperature=0.0, allowed_token_ids=[5, 6])
    logits = torch.randn(2, V)
    rows = [row(ok, [1, 2], [3], "fine"), row(banned, [1, 2], [3], "empty")]
    with pytest.raises(RequestFault) as info:
        Sampler(torch.device("cpu")).sample(logits.clone(), rows)
    assert info.value.request_ids == ["empty"]
    tokens, _ = Sampler(torch.device("cpu")).sample(logits.clone()[:1], rows[:1])  # the other request samples
    assert tokens[0] in (5, 6)
