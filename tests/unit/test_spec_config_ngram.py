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
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    out = drafter.propose([_request("a", tokens, 7), _request("b", tokens, 6),
                           _request("c", tokens, 7, max_num_drafts=2)])
    assert out == {"a": [3, 4, 5, 6], "c": [3, 4]}  # b is mid-prefill
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
