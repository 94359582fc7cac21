"""Structural tags in the engine on the default model (fp32): free text until a trigger, then
`begin`, JSON that validates (jsonschema) against the structure's schema, `end`, free text
again. vLLM's older shape (structures + triggers) on a few-shot prompt the model continues
with a call, and xgrammar's shape with the structure forced from the first token
(triggered_tags, at_least_one); greedy, sampled (n > 1) and under ngram speculation (drafts
copied from the prompt's calls, checked and rolled back against the grammar) give the tokens
of the plain engine."""
from __future__ import annotations

import json

import jsonschema
import pytest

from deepinfer import SamplingParams
from deepinfer.invalid_parameter import InvalidParameter
from deepinfer.structured.params import StructuredOutputsParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "days"]}
BEGIN, END = "<function=get_weather>", "</function>"
LEGACY = {"type": "structural_tag", "triggers": ["<function="],
          "structures": [{"begin": BEGIN, "schema": WEATHER, "end": END}]}
FORCED = {"type": "structural_tag", "format": {
    "type": "triggered_tags", "triggers": ["<function="], "at_least_one": True,
    "tags": [{"begin": BEGIN, "end": END, "content": {
        "type": "json_schema", "json_schema": WEATHER, "max_whitespace_cnt": 1}}]}}
FEW_SHOT = ('Q: What is the weather in Rome for 2 days?\n'
            'A: <function=get_weather>{"city": "Rome", "days": 2}</function>\n'
            'Q: What is the weather in Oslo for 5 days?\n'
            'A: <function=get_weather>{"city": "Oslo", "days": 5}</function>\n'
            'Q: What is the weather in Paris for 3 days?\nA:')
CHAT = ("<|im_start|>user\nWhat will the weather be in Paris for the next 3 days?<|im_end|>\n"
        "<|im_start|>assistant\n")


def tagged(tag: dict, max_tokens: int = 40, **kwargs) -> SamplingParams:
    kwargs.setdefault("temperature", 0.0)
    return SamplingParams(max_tokens=max_tokens, **kwargs,
                          structured_outputs=StructuredOutputsParams(structural_tag=tag))


def calls(text: str, finish_reason: str) -> list[dict]:
    """The JSON values between each begin and its end, each validated against WEATHER; a
    call cut off by max_tokens may only be the last thing in the text."""
    found = []
    rest = text
    while BEGIN in rest:
        rest = rest.split(BEGIN, 1)[1]
        if END not in rest:
            assert finish_reason == "length", text
            break
        body, rest = rest.split(END, 1)
        value = json.loads(body)
        jsonschema.validate(value, WEATHER)
        found.append(value)
    return found


def test_free_text_with_triggered_structures(engine_base_llm):
    """The older shape: the few-shot prompt makes the model write a call itself; greedy, the
    output is the plain engine's (the grammar admits it), and each call validates."""
    plain = engine_base_llm.generate([FEW_SHOT], SamplingParams(max_tokens=40, temperature=0.0),
                                     use_tqdm=False)[0].outputs[0]
    greedy = engine_base_llm.generate([FEW_SHOT], tagged(LEGACY), use_tqdm=False)[0].outputs[0]
    assert greedy.token_ids == plain.token_ids
    assert greedy.text.startswith(" " + BEGIN)  # free text (a space), then the structure
    assert calls(greedy.text, greedy.finish_reason)[0] == {"city": "Paris", "days": 3}
    sampled = engine_base_llm.generate([FEW_SHOT], tagged(LEGACY, temperature=1.0, seed=3, n=3),
                                       use_tqdm=False)[0].outputs
    assert len(sampled) == 3 and sum(len(calls(o.text, o.finish_reason)) for o in sampled) >= 3


def test_a_structure_forced_from_the_first_token(engine_base_llm):
    """xgrammar's shape with at_least_one: a chat answer that would be prose begins with the
    structure, its JSON validates, and free text may follow the end."""
    for params in (tagged(FORCED, 60), tagged(FORCED, 60, temperature=1.0, seed=3, n=3)):
        for out in engine_base_llm.generate([CHAT], params, use_tqdm=False)[0].outputs:
            assert out.text.startswith(BEGIN), out.text
            assert len(calls(out.text, out.finish_reason)) >= 1, out.text


def test_speculation_gives_the_same_tagged_tokens(engine_base_llm, make_engine_llm):
    llm = make_engine_llm(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                              "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    for prompt, params in ((FEW_SHOT, tagged(LEGACY)), (FEW_SHOT, tagged(FORCED)),
                           (CHAT, tagged(FORCED, temperature=1.0, seed=5, n=2))):
        want = engine_base_llm.generate([prompt], params, use_tqdm=False)[0].outputs
        got = llm.generate([prompt], params, use_tqdm=False)[0].outputs
        assert [o.token_ids for o in got] == [o.token_ids for o in want]


@pytest.mark.parametrize("tag", [
    {**LEGACY, "triggers": ["<tool>"]},  # a trigger that starts no begin
    {"type": "structural_tag", "format": {"type": "json_schema", "json_schema": {
        "type": "integer", "not": {"const": 3}}}},  # xgrammar would not enforce `not`
])
def test_bad_tags_are_refused_before_queueing(engine_base_llm, tag):
    with pytest.raises(InvalidParameter) as info:
        engine_base_llm.generate([CHAT], tagged(tag), use_tqdm=False)
    assert info.value.param == "structured_outputs"
    out = engine_base_llm.generate([CHAT], tagged(FORCED, 2), use_tqdm=False)[0].outputs[0]
    assert BEGIN.startswith(out.text) and out.text  # the engine goes on
