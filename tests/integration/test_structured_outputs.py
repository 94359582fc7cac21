"""Structured outputs in the engine on the default model (fp32): outputs under a JSON schema
parse and validate (jsonschema), choices are one of the choices, a regex is matched in full,
and a grammar that admits the unconstrained greedy output leaves it token for token the same
(the mask removes only tokens the plain path would not pick). Speculative decoding (ngram and
a mostly-wrong draft model) gives exactly the tokens of the same engine without it."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from deepinfer import SamplingParams
from deepinfer.sampling_params import InvalidParameter
from deepinfer.structured.params import StructuredOutputsParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"]}
SCHEMAS = [
    PERSON,
    {"type": "object", "properties": {  # nested object, array, enum
        "city": {"type": "string", "enum": ["Paris", "Berlin", "Rome"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                 "minItems": 1, "maxItems": 3},
        "owner": PERSON},
     "required": ["city", "tags", "owner"]},
    {"type": "object", "properties": {  # anyOf, numeric bounds, boolean
        "value": {"anyOf": [{"type": "integer", "minimum": 10, "maximum": 99},
                            {"type": "boolean"}]},
        "score": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["value", "score"]},
]
# several schemas at once: xgrammar would not enforce it, llguidance does
PERSON_IN_A_CITY = {"allOf": [PERSON, {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome"]}}, "required": ["city"]}]}
SCHEMAS.append(PERSON_IN_A_CITY)
PROMPT = ("<|im_start|>user\nDescribe a person as JSON with a name and an age.<|im_end|>\n"
          "<|im_start|>assistant\n")


def constrained(max_tokens: int = 120, **kwargs) -> SamplingParams:
    kind = {k: v for k, v in kwargs.items() if k in ("json", "json_object", "regex", "choice",
                                                     "grammar")}
    rest = {k: v for k, v in kwargs.items() if k not in kind}
    rest.setdefault("temperature", 0.0)
    return SamplingParams(max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(**kind),
                          **rest)


@pytest.mark.parametrize("schema", SCHEMAS, ids=["person", "nested", "any_of", "all_of"])
def test_json_schema_outputs_validate(engine_base_llm, schema):
    greedy = engine_base_llm.generate([PROMPT], constrained(json=schema), use_tqdm=False)
    sampled = engine_base_llm.generate([PROMPT], constrained(json=schema, temperature=1.0, seed=3,
                                                             n=3), use_tqdm=False)
    for out in greedy[0].outputs + sampled[0].outputs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)


def test_json_object_parses(engine_base_llm):
    out = engine_base_llm.generate([PROMPT], constrained(json_object=True, temperature=0.8,
                                                         seed=1, n=2), use_tqdm=False)[0]
    for choice in out.outputs:
        assert choice.finish_reason == "stop", choice.text
        assert isinstance(json.loads(choice.text), dict)


def test_choice_and_regex(engine_base_llm):
    choices = ["positive", "negative", "neutral \"maybe\""]
    prompt = "Review: the film was wonderful. Sentiment:"
    out = engine_base_llm.generate([prompt], constrained(choice=choices, temperature=1.0, seed=0,
                                                         n=4), use_tqdm=False)[0]
    assert all(c.text in choices and c.finish_reason == "stop" for c in out.outputs)
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    out = engine_base_llm.generate(["Give me a code:"], constrained(regex=pattern),
                                   use_tqdm=False)[0].outputs[0]
    assert re.fullmatch(pattern, out.text), out.text


def test_grammar_admitting_the_greedy_output_changes_nothing(engine_base_llm):
    prompts = [PROMPT, "The capital of France is"]
    plain = engine_base_llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24),
                                     use_tqdm=False)
    for prompt, ref in zip(prompts, plain):
        text = ref.outputs[0].text
        # Narrow: only that text (or another string); broad: any text.
        for kind in ({"choice": [text, "something else entirely"]},
                     {"regex": r"[\s\S]*"},
                     {"grammar": 'root ::= [^\\x00]*'}):
            got = engine_base_llm.generate([prompt], constrained(24, **kind), use_tqdm=False)
            assert got[0].outputs[0].token_ids == ref.outputs[0].token_ids, kind


@pytest.mark.parametrize("spec", [
    {"json": '{"type": "object", "properties": {"a": {"$ref": "#/defs/missing"}}}'},
    {"regex": "(unclosed"},
    {"grammar": "root ::= undefined_rule"},
    {"json": '{"type": "integer", "not": {"const": 3}}'},  # neither library enforces `not`
])
def test_bad_specs_are_refused_before_queueing(engine_base_llm, spec):
    with pytest.raises(InvalidParameter) as info:
        engine_base_llm.generate([PROMPT], constrained(**spec), use_tqdm=False)
    assert info.value.param == "structured_outputs"
    # the engine goes on
    assert engine_base_llm.generate([PROMPT], constrained(8, choice=["ok"]),
                                    use_tqdm=False)[0].outputs[0].text == "ok"


def test_speculation_gives_the_same_structured_tokens(engine_base_llm, make_engine_llm):
    """ngram drafts copy the prompt's JSON, so many are checked against the grammar, some
    accepted and some rolled back; the tokens are those of the plain engine."""
    prompts = [PROMPT + '{"name": "', PROMPT]
    params = [constrained(json=PERSON), constrained(json=PERSON, temperature=1.0, seed=5),
              constrained(json=PERSON_IN_A_CITY, temperature=1.0, seed=5)]  # on llguidance
    llm = make_engine_llm(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                              "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    for p in params:
        want = engine_base_llm.generate(prompts, p, use_tqdm=False)
        got = llm.generate(prompts, p, use_tqdm=False)
        for a, b in zip(got, want):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
