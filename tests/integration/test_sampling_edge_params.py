"""Extreme but valid sampling values on the offline engine: no NaN, no crash of the whole
engine step, and the results the limits imply (found by the server fuzz; the server maps
these too, the offline `LLM` must not depend on it)."""
from __future__ import annotations

import pytest

from deepinfer import SamplingParams
from tests.integration.engine_checks import generate_checked

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPT = "The three primary colours are"


@pytest.fixture(scope="module")
def greedy_tokens(engine_base_llm):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    return list(generate_checked(engine_base_llm, [PROMPT], params)[0].outputs[0].token_ids)


@pytest.mark.parametrize("extreme", [{"temperature": 1e-9}, {"temperature": 1e-30},
                                     {"temperature": 0.7, "top_p": 1e-12},
                                     {"temperature": 0.7, "top_p": 5e-324}],
                         ids=["temp=1e-9", "temp=1e-30", "top_p=1e-12", "top_p=denormal"])
def test_vanishing_temperature_or_top_p_equals_greedy(engine_base_llm, greedy_tokens, extreme):
    params = SamplingParams(seed=3, max_tokens=12, ignore_eos=True, **extreme)
    out = generate_checked(engine_base_llm, [PROMPT], params)[0].outputs[0]
    assert list(out.token_ids) == greedy_tokens


def test_stop_token_id_outside_the_vocabulary_is_a_clear_error(engine_base_llm):
    vocab = engine_base_llm.engine.model_config.vocab_size
    params = SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[vocab + 5])
    with pytest.raises(ValueError, match="stop_token_ids"):
        engine_base_llm.generate([PROMPT], params)
    # The engine still serves the next request.
    ok = generate_checked(engine_base_llm, [PROMPT], SamplingParams(temperature=0.0, max_tokens=3))
    assert len(ok[0].outputs[0].token_ids) == 3


def test_sampling_params_map_vanishing_values():
    assert SamplingParams(temperature=1e-9).temperature == 0.0
    assert SamplingParams(temperature=1e-9).greedy
    assert SamplingParams(top_p=1e-300).top_p == pytest.approx(1e-7)
    assert SamplingParams(temperature=0.5, top_p=0.9).top_p == 0.9
    with pytest.raises(ValueError):
        SamplingParams(temperature=float("nan"))
    with pytest.raises(ValueError):
        SamplingParams(top_p=float("nan"))
