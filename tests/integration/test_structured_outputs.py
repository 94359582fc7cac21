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
from deepinfer.invalid_parameter import InvalidParameter
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


class _GatedCache:
    """The engine's grammar cache with one spec's compile held until `release`."""

    def __init__(self, cache, spec) -> None:
        import threading
        self.cache, self.key, self.gate = cache, spec.key(), threading.Event()
        self.real_get = cache.get
        self.started = threading.Event()

    def __enter__(self):
        def get(spec):
            if spec.key() == self.key:
                self.started.set()
                assert self.gate.wait(60)
            return self.real_get(spec)
        self.cache.get = get
        return self

    def __exit__(self, *exc):
        self.gate.set()
        self.cache.get = self.real_get


def _run_engine(engine, until):
    outputs = {}
    for _ in range(2000):
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
        if until(outputs):
            return outputs
    raise AssertionError(f"engine did not get there: {sorted(outputs)}")


def test_a_compiling_grammar_does_not_hold_up_other_requests(engine_base_llm):
    """A new schema compiles off the engine loop: a plain request added with it finishes
    while the compile is still held, then the structured one runs and validates."""
    engine = engine_base_llm.engine
    schema = {"type": "object", "properties": {"held": {"type": "integer"}}, "required": ["held"]}
    spec = StructuredOutputsParams(json=schema)
    with _GatedCache(engine.grammar_cache, spec) as gated:
        engine.add_request("held", engine.tokenizer.encode(PROMPT), constrained(40, json=schema))
        engine.add_request("plain", engine.tokenizer.encode("The capital of France is"),
                           SamplingParams(temperature=0.0, max_tokens=8))
        outputs = _run_engine(engine, lambda outs: "plain" in outs)
        assert gated.started.is_set() and "held" not in outputs
        gated.gate.set()
        outputs = _run_engine(engine, lambda outs: "held" in outs)
    assert outputs["held"].outputs[0].finish_reason == "stop"
    jsonschema.validate(json.loads(outputs["held"].outputs[0].text), schema)
    assert not engine.has_unfinished_requests() and len(engine.grammar_admission) == 0


def test_a_request_aborted_or_failing_while_its_grammar_compiles(engine_base_llm):
    engine = engine_base_llm.engine
    schema = {"type": "object", "properties": {"gone": {"type": "string"}}}
    with _GatedCache(engine.grammar_cache, StructuredOutputsParams(json=schema)) as gated:
        engine.add_request("gone", engine.tokenizer.encode(PROMPT), constrained(8, json=schema))
        engine.step()
        engine.abort_request(["gone"])
        assert not engine.has_unfinished_requests() and len(engine.grammar_admission) == 0
    failing = {"type": "object", "properties": {"fails": {"type": "string"}}}
    spec = StructuredOutputsParams(json=failing)
    real_get = engine.grammar_cache.get

    def get(s):
        if s.key() == spec.key():
            raise RuntimeError("no memory for this grammar")
        return real_get(s)
    engine.grammar_cache.get = get
    try:
        with pytest.raises(RuntimeError, match="grammar could not be used.*no memory"):
            engine_base_llm.generate([PROMPT], constrained(8, json=failing), use_tqdm=False)
    finally:
        engine.grammar_cache.get = real_get
    assert engine_base_llm.generate([PROMPT], constrained(8, choice=["ok"]),
                                    use_tqdm=False)[0].outputs[0].text == "ok"
