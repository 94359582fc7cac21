"""Rejection sampling of drafts and the runner's verification step, on synthetic logits.

* With a sampled drafter (q given), emitted tokens follow the target's p at every position
  (chi-square over many seeded trials; fixed seeds, so deterministic), while taking the drafts
  as they come would not (the same test rejects q's samples: it has power).
* With one-hot q the verifier's tokens at every position are exactly the plain sampler's for
  the same (seed, position): greedy and seeded outputs equal those without speculation.
"""
from __future__ import annotations

import dataclasses

import torch

from deepinfer.core.scheduler_output import ScheduledRequest
from deepinfer.runtime.sampler import Sampler
from deepinfer.sampling_params import SamplingParams
from deepinfer.spec.rejection_sampler import num_matching, rejection_sample
from deepinfer.spec.verifier import SpecVerifier
from tests.chi_square import chi_square_pvalue

V = 6


def _dist(gen: torch.Generator, rows: int, sharp: float) -> torch.Tensor:
    return torch.softmax(sharp * torch.randn(rows, V, generator=gen), dim=-1)


def test_num_matching():
    assert num_matching([1, 2, 3], [1, 2, 4]) == 2
    assert num_matching([5, 2], [1]) == 0
    assert num_matching([1, 2, 9], [1, 2]) == 2


def test_rejection_sampling_emits_the_target_distribution_at_every_position():
    gen = torch.Generator().manual_seed(0)
    p = _dist(gen, 3, 1.5)  # target rows for positions 0, 1 and the bonus
    q = _dist(gen, 2, 1.5)  # a drafter that disagrees with it
    q[0, 3] = 0.0  # and never proposes token 3 at position 0
    q[0] /= q[0].sum()
    counts = [[0] * V for _ in range(3)]
    draft_counts = [0] * V
    for _ in range(12000):
        drafts = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(2)]
        draft_counts[drafts[0]] += 1
        uniforms = torch.rand(2, generator=gen)
        noise = torch.empty(3, V).exponential_(generator=gen)
        emitted = rejection_sample(p, q, drafts, uniforms, noise)
        assert 1 <= len(emitted) <= 3
        for j, token in enumerate(emitted):
            counts[j][token] += 1
            if j < len(emitted) - 1:
                assert token == drafts[j]  # accepted tokens are the drafts
    # Position j's token (when emitted) follows p[j]: here p does not depend on the prefix.
    for j in range(3):
        assert chi_square_pvalue(counts[j], p[j].tolist()) > 1e-3, (j, counts[j], p[j])
    assert counts[0][3] > 0  # reached only through the residual
    assert chi_square_pvalue(draft_counts, p[0].tolist()) < 1e-6  # the check has power


def test_rejection_sampling_when_p_equals_q_accepts_everything():
    gen = torch.Generator().manual_seed(1)
    p = _dist(gen, 3, 1.0)
    drafts = [1, 4]
    out = rejection_sample(p, p[:2].clone(), drafts, torch.full((2,), 0.999),
                           torch.ones(3, V))
    assert out[:2] == drafts and out[2] == int(p[2].argmax())


class FakeModel:
    """compute_logits returns fixed rows (the hidden states are row indices)."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits[hidden[:, 0].long()].clone()


class OneHotDrafter:
    def take_draft_probs(self, request_id, draft_token_ids):
        return None


def _sched(rid, tokens, num_drafts, params, num_output=3) -> ScheduledRequest:
    return ScheduledRequest(rid, tokens, 10, [0, 1], True, params, num_output,
                            num_draft_tokens=num_drafts)


def test_verifier_positions_sample_as_the_plain_sampler_would():
    gen = torch.Generator().manual_seed(2)
    logits = 3.0 * torch.randn(9, V, generator=gen)
    greedy = SamplingParams(temperature=0.0, logprobs=2)
    seeded = SamplingParams(temperature=1.0, seed=7, logprobs=1)
    plain = Sampler(torch.device("cpu"))
    want, want_lp = [], []  # each row sampled alone, at its own output position
    for row in range(9):
        params, position = (greedy, 3 + row) if row < 4 else (seeded, 3 + row - 4)
        if row == 8:
            position = 0
        token, lp = plain.sample(logits[row:row + 1].clone(), [_sched("x", [0], 0, params, position)])
        want.append(token[0])
        want_lp.append(lp["x"])
    g_drafts = [want[0], want[1], (want[2] + 1) % V]  # two right, the third wrong
    s_drafts = [(want[4] + 1) % V, want[5], want[6]]  # the first wrong
    ordered = [_sched("g", [9] + g_drafts, 3, greedy), _sched("s", [9] + s_drafts, 3, seeded),
               _sched("d", [5], 0, seeded, num_output=0)]
    hidden = torch.arange(9, dtype=torch.float32).unsqueeze(1)  # rows 0-3: g, 4-7: s, 8: d
    verifier = SpecVerifier(Sampler(torch.device("cpu")), OneHotDrafter())
    result = verifier.sample(FakeModel(logits), hidden, ordered)
    assert result.verified_token_ids == {"g": want[0:3], "s": [want[4]]}
    assert result.sampled_token_ids == {"d": want[8]}
    assert [lp.logprob for lp in result.verified_logprobs["g"]] == \
        [lp.logprob for lp in want_lp[0:3]]
    assert result.verified_logprobs["s"][0] == want_lp[4]
    assert result.logprobs["d"] == want_lp[8]


def test_verifier_applies_min_tokens_per_position():
    logits = torch.zeros(3, V)
    logits[:, 2] = 5.0  # EOS is every row's argmax
    params = SamplingParams(temperature=0.0, min_tokens=5)
    r = dataclasses.replace(_sched("m", [9, 2, 2], 2, params, num_output=3),
                            eos_token_ids=(2,))
    hidden = torch.arange(3, dtype=torch.float32).unsqueeze(1)
    result = SpecVerifier(Sampler(torch.device("cpu")), OneHotDrafter()).sample(
        FakeModel(logits), hidden, [r])
    # positions 3 and 4 may not end the sequence: the first draft (EOS) is rejected there
    assert result.verified_token_ids["m"][0] != 2
