"""The sampler on hand-made logits: top-k / top-p / min-p truncation against a plain
Python reference (ties, combinations, temperature, different parameters per row of one batch),
and seeded draws that are a pure function of (seed, output position)."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from deepinfer.core.scheduler_output import ScheduledRequest
from deepinfer.runtime.sampler import Sampler, truncate_logits
from deepinfer.sampling_params import SamplingParams

CPU = torch.device("cpu")


def logits_of(probs: list[float], vocab: int = 8) -> list[float]:
    """Log-probabilities padded to `vocab` with tokens of ~zero probability."""
    return [math.log(p) for p in probs] + [-30.0] * (vocab - len(probs))


def reference_kept(row: list[float], p: SamplingParams) -> set[int]:
    """Tokens that may be drawn: min_p, then top_k, then top_p on the renormalised rest, each
    keeping every token tied with the last one it keeps (float64, one token at a time)."""
    x = [v / p.temperature for v in row]
    kept = set(range(len(x)))

    def probs_over(ids):
        m = max(x[i] for i in ids)
        e = {i: math.exp(x[i] - m) for i in ids}
        z = sum(e.values())
        return {i: v / z for i, v in e.items()}

    if p.min_p > 0:
        pr = probs_over(kept)
        kept = {i for i in kept if pr[i] >= p.min_p * max(pr.values())}
    if 0 < p.top_k < len(kept):
        kth = sorted((x[i] for i in kept), reverse=True)[p.top_k - 1]
        kept = {i for i in kept if x[i] >= kth}
    if p.top_p < 1.0:
        pr = probs_over(kept)
        mass, last = 0.0, None
        for i in sorted(kept, key=lambda i: -x[i]):
            if mass >= p.top_p:
                break
            mass += pr[i]
            last = x[i]
        kept = {i for i in kept if x[i] >= last}
    return kept


def sp(**kwargs) -> SamplingParams:
    kwargs.setdefault("temperature", 1.0)
    return SamplingParams(**kwargs)


# (name, logits, params, the kept set worked out by hand)
CASES = [
    ("top_k=3", logits_of([0.3, 0.25, 0.2, 0.15, 0.1]), sp(top_k=3), {0, 1, 2}),
    ("top_k=2 ties at the boundary", [3.0, 2.0, 2.0, 2.0, 1.0, 0.0, -1.0, -2.0], sp(top_k=2),
     {0, 1, 2, 3}),
    ("top_k=2 ties above it", [3.0, 3.0, 3.0, 1.0, 0.0, -1.0, -2.0, -3.0], sp(top_k=2),
     {0, 1, 2}),
    ("top_k > vocab", [1.0, 0.5, 0.0, -0.5, -1.0, -1.5, -2.0, -2.5], sp(top_k=50), set(range(8))),
    ("top_p=0.65", logits_of([0.4, 0.3, 0.2, 0.1]), sp(top_p=0.65), {0, 1}),
    ("top_p=0.75", logits_of([0.4, 0.3, 0.2, 0.1]), sp(top_p=0.75), {0, 1, 2}),
    ("top_p ties", logits_of([0.3, 0.3, 0.3, 0.1]), sp(top_p=0.5), {0, 1, 2}),
    ("top_p keeps the top token", logits_of([0.9, 0.1]), sp(top_p=0.01), {0}),
    ("min_p=0.15", logits_of([0.5, 0.3, 0.1, 0.06, 0.04]), sp(min_p=0.15), {0, 1, 2}),
    ("min_p ties", logits_of([0.3, 0.3, 0.3, 0.1]), sp(min_p=0.5), {0, 1, 2}),
    # top_p applies to the top-k set renormalised (0.35+0.25+0.2 = 0.8): 0.4375, 0.3125, 0.25.
    ("top_k then top_p", logits_of([0.35, 0.25, 0.2, 0.1, 0.1]), sp(top_k=3, top_p=0.7), {0, 1}),
    # min_p keeps 0.4, 0.3, 0.2 (renormalised 0.444, 0.333, 0.222), so top_p=0.75 keeps two.
    ("min_p then top_p", logits_of([0.4, 0.3, 0.2, 0.05, 0.05]), sp(min_p=0.2, top_p=0.75),
     {0, 1}),
    ("all three", logits_of([0.3, 0.2, 0.2, 0.2, 0.05, 0.05]),
     sp(min_p=0.2, top_k=2, top_p=0.5), {0, 1, 2, 3}),
    # Temperature first: at 0.5 the top token's share grows from 0.5 to 0.66 > top_p.
    ("temperature then top_p", logits_of([0.5, 0.3, 0.2]), sp(temperature=0.5, top_p=0.55), {0}),
    ("temperature 1 top_p", logits_of([0.5, 0.3, 0.2]), sp(top_p=0.55), {0, 1}),
    ("no truncation", [0.0] * 8, sp(), set(range(8))),
]
IDS = [c[0] for c in CASES]


@pytest.mark.parametrize("name,row,params,want", CASES, ids=IDS)
def test_reference_agrees_with_the_hand_worked_sets(name, row, params, want):
    logits32 = torch.tensor([row]).tolist()[0]  # the float32 values the sampler sees
    assert reference_kept(logits32, params) == want


def test_truncation_per_row_params_in_one_batch():
    logits = torch.tensor([c[1] for c in CASES], dtype=torch.float32)
    params = [c[2] for c in CASES]
    temps = torch.tensor([p.temperature for p in params]).unsqueeze(1)
    out = truncate_logits(logits / temps, params)
    for i, (name, row, p, want) in enumerate(CASES):
        kept = set(torch.nonzero(torch.isfinite(out[i])).flatten().tolist())
        assert kept == reference_kept(logits[i].tolist(), p) == want, name
        # Kept tokens keep their (temperature-scaled) logits.
        assert torch.equal(out[i, sorted(kept)], (logits[i] / p.temperature)[sorted(kept)]), name


def test_truncation_of_random_rows_matches_reference():
    gen = torch.Generator().manual_seed(0)
    rows, params = [], []
    for i in range(200):
        vocab = 12
        # Rounded logits produce many exact ties.
        rows.append((torch.randn(vocab, generator=gen) * 2).round(decimals=0).tolist())
        params.append(sp(temperature=[0.5, 1.0, 1.7][i % 3], top_k=[0, 1, 3, 5][i % 4],
                         top_p=[1.0, 0.3, 0.6, 0.9, 0.97][i % 5],
                         min_p=[0.0, 0.05, 0.3][i % 7 % 3]))
    logits = torch.tensor(rows)
    temps = torch.tensor([p.temperature for p in params]).unsqueeze(1)
    out = truncate_logits(logits / temps, params)
    mismatches = []
    for i, p in enumerate(params):
        kept = set(torch.nonzero(torch.isfinite(out[i])).flatten().tolist())
        if kept != reference_kept(rows[i], p):
            mismatches.append((i, sorted(kept), sorted(reference_kept(rows[i], p))))
    # A float32 / float64 disagreement is possible only when top_p lands exactly on a
    # cumulative mass; these rows keep clear of that.
    assert not mismatches, mismatches[:5]


def scheduled(i: int, params: SamplingParams, position: int = 0) -> ScheduledRequest:
    return ScheduledRequest(f"r{i}", [1], 0, [0], True, params, num_output_tokens=position)


def test_sampled_tokens_are_exactly_the_kept_sets():
    """Draw each case 400 times (seeded, in one batch): every kept token of non-negligible
    probability is drawn, and nothing else ever is."""
    draws = 400
    logits = torch.tensor([c[1] for c in CASES for _ in range(draws)], dtype=torch.float32)
    requests = [scheduled(i, dataclasses.replace(c[2], seed=s))
                for i, c in enumerate(CASES) for s in range(draws)]
    tokens, _ = Sampler(CPU).sample(logits, requests)
    for i, (name, row, p, want) in enumerate(CASES):
        drawn = set(tokens[i * draws:(i + 1) * draws])
        assert drawn <= want, f"{name}: drew {sorted(drawn - want)} outside {sorted(want)}"
        likely = {t for t in want if math.exp(row[t]) / sum(math.exp(row[u]) for u in want) > 0.02}
        assert likely <= drawn, f"{name}: never drew {sorted(likely - drawn)}"


def test_greedy_and_random_rows_mix():
    row = logits_of([0.1, 0.6, 0.3])
    logits = torch.tensor([row, row, row])
    requests = [scheduled(0, sp(temperature=0.0)), scheduled(1, sp(top_k=1, seed=3)),
                scheduled(2, sp(top_p=0.5, seed=4))]
    tokens, _ = Sampler(CPU).sample(logits, requests)
    assert tokens == [1, 1, 1]


# ---- seeds: the draw for output position i depends on (seed, i) only ------------------------
VOCAB = 1000


def draw(sampler: Sampler, params: SamplingParams, position: int, batch_with=()) -> int:
    """Sample one seeded request at `position` from flat logits (every token equally likely:
    the token is decided by the noise alone), optionally behind other rows in the batch."""
    others = [scheduled(100 + j, p) for j, p in enumerate(batch_with)]
    logits = torch.zeros(len(others) + 1, VOCAB)
    tokens, _ = sampler.sample(logits, others + [scheduled(0, params, position)])
    return tokens[-1]


def test_seeded_draw_depends_only_on_seed_and_position():
    params = sp(seed=1234)
    walked = Sampler(CPU, seed=0)
    sequence = [draw(walked, params, i) for i in range(16)]
    # A fresh sampler (a preempted request recomputed, or a decode worker after the handoff)
    # resumes at position i and must draw what the uninterrupted run drew there.
    for i in (1, 7, 15):
        assert draw(Sampler(CPU, seed=99), params, i) == sequence[i], f"position {i}"
    # ... whatever else shares the batch.
    crowd = [sp(), sp(seed=5), sp(temperature=0.0)]
    assert [draw(walked, params, i, crowd) for i in range(16)] == sequence


def test_different_positions_get_different_noise():
    """The old bug: a sampler re-created at every position (as after a preemption) drew the
    first position's noise again, so the flat distribution gave one token over and over."""
    params = sp(seed=7)
    tokens = [draw(Sampler(CPU), params, i) for i in range(32)]
    assert len(set(tokens)) >= 28, tokens


def test_n_children_noise_is_not_shifted():
    """n > 1 children are seeded seed + index: child 1 at position i must not replay child 0
    at position i + 1 (or i)."""
    child0 = [draw(Sampler(CPU), sp(seed=40), i) for i in range(33)]
    child1 = [draw(Sampler(CPU), sp(seed=41), i) for i in range(32)]
    assert sum(a == b for a, b in zip(child1, child0[1:])) <= 2
    assert sum(a == b for a, b in zip(child1, child0)) <= 2


def test_unseeded_rows_still_vary():
    sampler = Sampler(CPU, seed=0)
    tokens = [draw(sampler, sp(), 0) for _ in range(32)]
    assert len(set(tokens)) >= 28


# ---- row_argmax: the blocked CPU argmax the greedy path uses --------------------

@pytest.mark.parametrize("vocab", [49152, 32000, 151936, 1000, 513, 300])
def test_row_argmax_equals_torch_argmax_with_ties_nan_and_inf(vocab, monkeypatch):
    import deepinfer.runtime.sampler as sampler_module
    from deepinfer.runtime.sampler import row_argmax
    monkeypatch.setattr(sampler_module, "_ARGMAX_MIN_ROWS", 1)  # the blocked path for every batch
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(9, vocab, generator=gen)
    x[0, 5] = x[0, 9] = x[0, vocab - 1] = 100.0  # tie: the first index wins
    x[1, vocab - 1] = 100.0  # maximum in the (maybe short) last block
    x[2, :] = float("-inf")  # all -inf: index 0
    x[3, vocab // 2] = float("nan")  # NaN counts as the maximum
    x[4, vocab // 3] = float("inf")
    x[5, :] = 7.0  # all equal
    x[6, 511 % vocab] = x[6, 512 % vocab] = 50.0  # a tie across a block boundary
    x[7, 0] = 60.0
    got = row_argmax(x)
    assert got.dtype == torch.long
    assert torch.equal(got, x.argmax(dim=-1))
    assert torch.equal(row_argmax(x[2:5]), x[2:5].argmax(dim=-1))  # a row subset (gathered copy)


def test_greedy_sampling_uses_first_index_of_tied_maximum():
    logits = torch.full((2, 4096), -5.0)
    logits[0, [3000, 1200]] = 9.0
    logits[1, [4095, 700]] = 9.0
    greedy = ScheduledRequest("a", [1], 0, [0], True, SamplingParams(temperature=0.0), 0)
    tokens, _ = Sampler(CPU).sample(logits, [greedy, dataclasses.replace(greedy, request_id="b")])
    assert tokens == [1200, 700]
