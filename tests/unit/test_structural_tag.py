"""Structural tags (vLLM's structural_tag): both of vLLM's shapes, through response_format and
structured_outputs (JSON text or an object), become one canonical spec that crosses the wire;
every bad field is a 400 naming the request field and saying where; and the grammar, compiled
for the default model's own tokenizer, takes free text, a trigger, begin, JSON matching the
structure's schema, end and free text again, token by token, while it refuses invalid JSON or
a wrong end between begin and end."""
from __future__ import annotations

import json

import msgspec
import pytest

from deepinfer.invalid_parameter import InvalidParameter
from deepinfer.sampling_params import SamplingParams
from deepinfer.server.errors import APIError
from deepinfer.server.serving_completion import OpenAIServingCompletion
from deepinfer.structured.grammars import GrammarCache, build_grammar
from deepinfer.structured.params import StructuredOutputsParams
from deepinfer.wire.engine_messages import AddRequest
from tests.unit.test_api_request_fields import make, prepare_completion

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "days": {"type": "integer", "minimum": 1}},
           "required": ["city", "days"]}
TIME = {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}
LEGACY = {"type": "structural_tag", "triggers": ["<function="], "structures": [
    {"begin": "<function=get_weather>", "schema": WEATHER, "end": "</function>"},
    {"begin": "<function=get_time>", "schema": TIME, "end": "</function>"}]}


def _format(max_whitespace: int | None = 1) -> dict:
    def tag(name, schema):
        content = {"type": "json_schema", "json_schema": schema}
        if max_whitespace is not None:
            content["max_whitespace_cnt"] = max_whitespace
        return {"type": "tag", "begin": f"<function={name}>", "content": content,
                "end": "</function>"}
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": [
        "<function="], "tags": [tag("get_weather", WEATHER), tag("get_time", TIME)]}}


@pytest.fixture(scope="module")
def prepare():
    serving = make(OpenAIServingCompletion)
    return lambda **fields: prepare_completion(serving, **fields)[1].structured_outputs


@pytest.mark.parametrize("fields", [
    {"response_format": LEGACY},
    {"structured_outputs": {"structural_tag": json.dumps(LEGACY)}},  # as vLLM passes it
    {"structured_outputs": {"structural_tag": LEGACY}},
    {"response_format": _format()},  # xgrammar's shape, as the older one becomes
    {"structured_outputs": {"structural_tag": json.dumps(_format(), indent=1)}},
], ids=["rf-legacy", "so-text", "so-object", "rf-format", "so-format-text"])
def test_every_shape_becomes_one_canonical_spec(prepare, fields):
    spec = prepare(**fields)
    assert spec.kind == "structural_tag"
    assert spec.key() == StructuredOutputsParams(structural_tag=LEGACY).key()
    assert json.loads(spec.structural_tag) == _format()
    assert build_grammar(spec).backend == "xgrammar"


def test_the_cache_key_holds_the_whole_spec():
    other = json.loads(json.dumps(LEGACY))
    other["structures"][1]["end"] = "</fn>"
    keys = {StructuredOutputsParams(structural_tag=t).key()
            for t in (LEGACY, other, _format(None), _format(2))}
    assert len(keys) == 4


def test_the_spec_crosses_the_wire():
    spec = StructuredOutputsParams(structural_tag=LEGACY)
    message = AddRequest("r", [1, 2], SamplingParams(structured_outputs=spec, n=2), 0.0)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(message), type=AddRequest)
    assert decoded.sampling_params.structured_outputs == spec


def _tag(fmt: dict) -> dict:
    return {"type": "structural_tag", "format": fmt}


def _legacy(**change) -> dict:
    tag = json.loads(json.dumps(LEGACY))
    for key, value in change.items():
        if key.startswith("s0_"):
            tag["structures"][0][key[3:]] = value
        else:
            tag[key] = value
    return tag


ANY = {"type": "any_text"}
BAD = [
    ("{not json", "JSON object"),
    ([LEGACY], "JSON object"),
    ({"type": "structural", "format": ANY}, "type"),
    ({"type": "structural_tag"}, "format"),
    (_legacy(extra=1), "unknown field(s) extra"),
    (_legacy(structures=[]), "structures must be a non-empty list"),
    (_legacy(structures=["x"]), "structures[0] must be an object"),
    (_legacy(s0_begin=""), "structures[0].begin must be a non-empty string"),
    (_legacy(s0_begin=3), "structures[0].begin"),
    (_legacy(s0_end=None), "structures[0].end must be a string"),
    (_legacy(s0_schema="{oops"), "structures[0].schema is not valid JSON"),
    (_legacy(s0_name="f"), "unknown field(s) name"),
    (_legacy(triggers=[]), "triggers must be a non-empty list"),
    (_legacy(triggers="<function="), "triggers must be a non-empty list"),
    (_legacy(triggers=["<function=", ""]), "triggers must be a non-empty list"),
    (_legacy(triggers=["<tool>"]), "triggers[0] ('<tool>') is not a prefix of any begin"),
    (_legacy(triggers=["<function=get_w"]), "starts with no trigger"),
    (_legacy(s0_schema={"type": "strin"}), "invalid JSON schema at type"),
    (_legacy(s0_schema={"type": "integer", "not": {"const": 3}}), "uses not"),
    (_legacy(s0_schema=[1]), "a JSON schema must be an object"),
    (_tag({"type": "tag", "begin": "", "content": ANY, "end": "x"}), "begin must be a non-empty"),
    (_tag({"type": "tag", "begin": 1, "content": ANY, "end": "x"}), "valid string"),
    (_tag({"type": "any_text", "max_chars": "5"}), "valid integer"),
    (_tag({"type": "triggered_tags", "triggers": ["<a"], "tags": [], "at_least_one": 1}), "bool"),
    (_tag({"type": "any_text", "exclude": ["x"]}), "unknown field(s) exclude"),
    (_tag({"type": "sequence", "elements": [ANY, {"type": "xml"}]}), "elements.1"),
    (_tag({"type": "token", "token": "<|im_end|>"}), "token formats name tokens"),
    (_tag({"type": "sequence", "elements": [{"type": "any_tokens"}]}), "any_tokens formats"),
    (_tag({"type": "regex", "pattern": "(?=a)b"}), "look-around"),
    (_tag({"type": "regex", "pattern": "(unclosed"}), "cannot compile"),
    (_tag({"type": "grammar", "grammar": "root ::= missing"}), "cannot compile"),
    (_tag({"type": "dispatch", "rules": [["x", {"type": "json_schema", "json_schema": {
        "type": "array", "uniqueItems": True}}]]}), "rules[0][1].json_schema uses uniqueItems"),
    (_tag({"type": "triggered_tags", "triggers": ["<b"], "tags": [
        {"begin": "<a>", "content": ANY, "end": "</a>"}]}), "not a prefix of any begin"),
]


# response_format takes only an object: the other cases go through structured_outputs alone
CASES = [(where, tag, words) for tag, words in BAD
         for where in ("response_format", "structured_outputs")
         if where == "structured_outputs" or isinstance(tag, dict)]


@pytest.mark.parametrize("where,tag,words", CASES,
                         ids=[f"{w}-{i}" for i, (w, _, _) in enumerate(CASES)])
def test_bad_tags_are_400s_naming_the_field(prepare, where, tag, words):
    fields = ({"response_format": tag} if where == "response_format"
              else {"structured_outputs": {"structural_tag": tag}})
    with pytest.raises(APIError) as info:
        prepare(**fields)
    assert info.value.status_code == 400 and info.value.info.param == where, info.value.info
    assert words in info.value.info.message, info.value.info.message


def test_bad_tags_as_text_and_hostile_sizes(prepare):
    for tag in (json.dumps(_legacy(triggers=["<x"])), "", "   "):
        with pytest.raises(APIError) as info:
            prepare(structured_outputs={"structural_tag": tag})
        assert info.value.info.param == "structured_outputs"
    huge = _legacy(s0_schema={"type": "object", "description": "x" * 70000})
    deep: dict = {"type": "object"}
    for _ in range(5000):
        deep = {"type": "array", "items": deep}
    for tag, words in ((huge, "too large"), (_legacy(s0_schema=deep), "")):
        with pytest.raises(APIError) as info:
            prepare(response_format=tag)
        assert info.value.info.param == "response_format" and words in info.value.info.message
    with pytest.raises(APIError) as info:  # one constraint at a time
        prepare(response_format=LEGACY, structured_outputs={"regex": "a"})
    assert info.value.info.param == "structured_outputs"


def test_params_refuse_a_bad_tag_themselves():
    with pytest.raises(InvalidParameter):
        StructuredOutputsParams(structural_tag={"type": "structural_tag"})
    with pytest.raises(InvalidParameter):
        StructuredOutputsParams(structural_tag=LEGACY, regex="a")


# ------------------------------------------------------------ the grammar on the real vocabulary

@pytest.fixture(scope="module")
def tokenizer():
    from deepinfer.runtime.model_source import resolve_model
    return resolve_model(None).load_tokenizer()


@pytest.fixture(scope="module")
def cache(tokenizer):
    return GrammarCache(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def _accepts(cache, tokenizer, spec, text: str, finish: bool = True) -> bool:
    matcher = cache.get(spec).matcher()
    for token in tokenizer.encode(text, add_special_tokens=False):
        if not matcher.accept_token(token):
            return False
    if finish:
        return matcher.accept_token(tokenizer.eos_token_id) and matcher.is_terminated()
    return True


GOOD = ('Let me check. <function=get_weather>{"city": "Paris", "days": 3}</function> and the '
        'time: <function=get_time>{"tz":"CET"}</function> Done.')


@pytest.mark.parametrize("text", [
    GOOD,
    "No call at all, just text.",
    '<function=get_time>{"tz": "UTC"}</function>',
])
def test_the_grammar_takes_conforming_text(cache, tokenizer, text):
    for tag in (LEGACY, _format(None)):
        assert _accepts(cache, tokenizer, StructuredOutputsParams(structural_tag=tag), text), tag


@pytest.mark.parametrize("text", [
    '<function=get_weather>{"city": "Paris", "days": 3',  # unfinished: may not stop here
    '<function=get_weather>{"city": "Paris"}</function>',  # days is required
    '<function=get_weather>{"city": "Paris", "days": 0}</function>',  # minimum 1
    '<function=get_weather>{"city": "Paris", "days": 3, "x": 1}</function>',  # no other keys
    '<function=get_weather>{city: "Paris"}</function>',  # not JSON
    '<function=get_weather>{"city": "Paris", "days": 3}</func>',  # wrong end
    '<function=get_weather>{"city": "Paris", "days": 3}oops</function>',
    '<function=unknown>{"a": 1}</function>',  # a trigger starts only a known begin
    '<function=get_time>{"tz":  "CET"}</function>',  # two spaces: compact whitespace
])
def test_the_grammar_refuses_nonconforming_text(cache, tokenizer, text):
    spec = StructuredOutputsParams(structural_tag=LEGACY)
    assert not _accepts(cache, tokenizer, spec, text)
    if "  " not in text:  # xgrammar's own whitespace setting (unbounded) refuses the rest too
        assert not _accepts(cache, tokenizer, StructuredOutputsParams(
            structural_tag=_format(None)), text)
