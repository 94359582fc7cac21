"""SpeculativeConfig parsing (vLLM's --speculative-config) and the n-gram (prompt lookup) drafter."""
from __future__ import annotations

import pytest

from deepinfer.engine.engine_config import EngineConfig
from deepinfer.sampling_params import SamplingParams
from deepinfer.spec.drafter import DraftRequest
from deepinfer.spec.ngram import NgramDrafter, propose_ngram
from deepinfer.spec.spec_config import SpeculativeConfig


def test_parse_json_dict_and_defaults():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == \
        ("ngram", 4, 5, 5)
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2,
                                 "prompt_lookup_max": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)
    assert c.num_lookahead_tokens == 0
    c = SpeculativeConfig.parse({"method": "deepseek_mtp"})
    assert (c.method, c.num_speculative_tokens, c.num_lookahead_tokens) == ("mtp", 1, 1)
    c = SpeculativeConfig.parse({"method": "draft_model", "num_speculative_tokens": 3, "model": "x"})
    assert c.num_lookahead_tokens == 3 and c.model == "x"
    assert SpeculativeConfig.parse(None) is None
    assert EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 3}
                        ).speculative_config == SpeculativeConfig("ngram", 3)


@pytest.mark.parametrize("value, message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ({"num_speculative_tokens": 2}, "needs a 'method'"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "must be one of"),
    ({"method": "ngram"}, "needs num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, r"in \[1, 32\]"),
    ({"method": "ngram", "num_speculative_tokens": "3"}, r"in \[1, 32\]"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 0}, "positive"),
    ({"method": "mtp", "num_speculative_tokens": 1, "prompt_lookup_min": 2}, "'ngram' only"),
    ({"method": "ngram", "num_speculative_tokens": 1, "model": "m"}, "'draft_model' only"),
    ({"method": "ngram", "num_speculative_tokens": 1, "typo": 1}, "unknown speculative config keys"),
])
def test_bad_configs_are_clear_value_errors(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value)


def test_ngram_proposes_what_followed_the_longest_recent_match():
    # suffix [1, 2, 3] occurred at the start: propose what followed it
    assert propose_ngram([1, 2, 3, 4, 5, 9, 1, 2, 3], 1, 3, 3) == [4, 5, 9]
    # only [2, 3] recurs: too short for min 3
    assert propose_ngram([1, 2, 3, 4, 5, 9, 7, 2, 3], 3, 3, 3) == []
    # a longer match wins over a more recent shorter one
    assert propose_ngram([7, 8, 9, 50, 51, 0, 8, 9, 60, 7, 8, 9], 1, 3, 2) == [50, 51]
    # equal lengths: the most recent occurrence with k tokens after it
    assert propose_ngram([5, 6, 1, 5, 6, 2, 0, 0, 5, 6], 2, 2, 1) == [2]
    assert propose_ngram([5, 6, 1, 5, 6, 2, 5, 6], 2, 2, 3) == [2, 5, 6]
    # never more than there is, never from an empty history
    assert propose_ngram([4, 4], 1, 2, 5) == [4]
    assert propose_ngram([4], 1, 2, 5) == []
    assert propose_ngram([1, 2, 3], 1, 2, 0) == []


def _request(rid: str, tokens: list[int], computed: int, max_num_drafts: int = 8) -> DraftRequest:
    return DraftRequest(rid, tokens, computed, 1, [0], SamplingParams(), 1, max_num_drafts)


def test_ngram_drafter_drafts_decodes_only_within_their_cap():
    drafter = NgramDrafter(4, 1, 3)
    tokens = [1, 2, 3, 7, 1, 2, 3, 4, 5, 6, 1, 2, 3]
    out = drafter.propose([_request("a", tokens, 12), _request("b", tokens, 11),
                           _request("c", tokens, 12, max_num_drafts=2)])
    assert out == {"a": [4, 5, 6, 1], "c": [4, 5]}  # b is mid-prefill
    assert drafter.take_draft_probs("a", [3, 4]) is None  # deterministic: q one-hot


def test_backoff_skips_drafting_after_rejections_and_resets_on_acceptance():
    from deepinfer.spec.draft_backoff import DraftBackoff

    backoff = DraftBackoff(max_skip=4)
    pattern = []
    for _ in range(14):  # drafts always rejected: skip 1, 2, 4, 4 steps between tries
        allowed = backoff.allow("r")
        pattern.append(allowed)
        if allowed:
            backoff.observe("r", 3, 0)
    assert pattern == [True, False, True, False, False, True, False, False, False, False,
                       True, False, False, False]
    backoff.observe("r", 3, 2)  # an accepted draft: back to drafting every step after the skip
    while not backoff.allow("r"):
        pass
    backoff.observe("r", 3, 1)
    assert all(backoff.allow("r") for _ in range(3))
    backoff.observe("s", 0, 0)  # no drafts verified: nothing learned
    assert backoff.allow("s")


def _brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The proposal rule spelled out: longest n first; the latest earlier occurrence with k
    tokens after it, else the earliest; a 2-token match proposes at most 3 tokens."""
    length = len(tokens)
    if k <= 0:
        return []
    for n in range(max_n, min_n - 1, -1):
        ends = [e for e in range(n - 1, length - 1) if tokens[e - n + 1:e + 1] == tokens[length - n:]]
        if ends and length - n >= 0:
            full = [e for e in ends if e + k < length]
            end = full[-1] if full else ends[0]
            return tokens[end + 1:end + 1 + (min(k, 3) if n <= 2 else k)]
    return []


def test_ngram_matches_the_rule_on_random_sequences():
    import random

    rng = random.Random(0)
    for _ in range(3000):
        tokens = [rng.randrange(rng.choice([2, 3, 8])) for _ in range(rng.randrange(1, 30))]
        min_n = rng.randrange(1, 4)
        max_n, k = rng.randrange(min_n, 6), rng.randrange(0, 7)
        assert propose_ngram(tokens, min_n, max_n, k) == _brute_force(tokens, min_n, max_n, k), \
            (tokens, min_n, max_n, k)


def test_ngram_match_selection_at_the_end_of_the_context_and_overlapping():
    # overlapping occurrences: in a run of one token the suffix [4, 4] also ends at 1 and 2;
    # only the one ending at 1 has 2 tokens after it (the latest with a full continuation)
    assert propose_ngram([4, 4, 4, 4], 2, 2, 2) == [4, 4]
    # [1, 2, 3] ends at 2 and 9: the latest has 3 tokens after it but not 4
    tokens = [1, 2, 3, 9, 9, 9, 9, 1, 2, 3, 1, 2, 3]
    assert propose_ngram(tokens, 3, 3, 3) == [1, 2, 3]
    assert propose_ngram(tokens, 3, 3, 4) == [9, 9, 9, 9]
    # no occurrence has k tokens after it: the earliest (it has the most), cut at the end
    assert propose_ngram([7, 8, 9, 7, 8, 9], 3, 3, 5) == [7, 8, 9]
    # equal length, both with a full continuation: the most recent one
    assert propose_ngram([1, 2, 5, 6, 1, 2, 7, 8, 0, 1, 2], 2, 2, 2) == [7, 8]


def test_weak_two_token_matches_propose_fewer_drafts():
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 0, 9, 1, 2]
    assert propose_ngram(tokens, 2, 5, 5) == [3, 4, 5]  # only [1, 2] recurs
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2, 3]
    assert propose_ngram(tokens, 2, 5, 5) == [4, 5, 6, 7, 8]  # [1, 2, 3]: a 3-token match


def test_ngram_drafter_index_follows_each_request_and_rebuilds_when_it_changes():
    import random

    rng = random.Random(1)
    drafter = NgramDrafter(5, 2, 5)
    tokens = [rng.randrange(6) for _ in range(40)]
    for length in range(2, len(tokens) + 1):  # one token per step, as decodes grow
        out = drafter.propose([_request("r", tokens[:length], length - 1)])
        assert out.get("r", []) == propose_ngram(tokens[:length], 2, 5, 5)
    # the same id with other tokens (a new request): re-indexed, not appended to the old one
    other = [9, 8, 7, 9, 8]
    assert drafter.propose([_request("r", other, 4)]) == {"r": [7, 9, 8]}
    drafter.remove(["r"])
    assert drafter._indexes == {}
