"""Which library a structured-output spec goes to: xgrammar unless the schema uses a feature
xgrammar would accept and not enforce (then llguidance, which enforces `allOf` and refuses the
rest by name) or a schema xgrammar cannot compile and llguidance can. The llguidance path
writes the same compact JSON as the xgrammar path and enforces what it accepts."""
from __future__ import annotations

import json

import llguidance
import pytest
from xgrammar.testing import _is_grammar_accept_string as xgrammar_accepts

from deepinfer.invalid_parameter import InvalidParameter
from deepinfer.structured.grammars import build_grammar
from deepinfer.structured.llguidance_grammar import LLGuidanceMatcher
from deepinfer.structured.params import StructuredOutputsParams
from deepinfer.structured.schema_features import unenforced_by_xgrammar

INT = {"type": "integer"}
A_AND_B = {"allOf": [{"type": "object", "properties": {"a": INT}, "required": ["a"]},
                     {"type": "object", "properties": {"b": INT}, "required": ["b"]}]}


def backend(**spec) -> str:
    return build_grammar(StructuredOutputsParams(**spec)).backend


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": INT}, "required": ["a"]},
    {"allOf": [INT]},  # one schema: xgrammar enforces it
    {"type": "object", "properties": {"not": INT, "if": INT, "contains": INT}},  # names, not keywords
    {"enum": [{"not": 1}], "default": {"allOf": [1, 2]}},  # data, not schemas
    {"$defs": {"n": INT}, "type": "object", "properties": {"a": {"$ref": "#/$defs/n"}}},
    {"type": "array", "uniqueItems": False},
    {"type": "string", "pattern": "^[a-z]+(x|y)$"},
], ids=["object", "allOf-1", "keyword-names", "data", "refs", "uniqueItems-false", "pattern"])
def test_schemas_xgrammar_enforces_stay_on_xgrammar(schema):
    assert unenforced_by_xgrammar(schema) == []
    assert backend(json=schema) == "xgrammar"


def test_an_allof_of_several_schemas_goes_to_llguidance():
    assert unenforced_by_xgrammar(A_AND_B) == ["allOf"]
    assert backend(json=A_AND_B) == "llguidance"
    assert backend(json={"type": "object", "properties": {"x": A_AND_B}}) == "llguidance"


def test_a_schema_xgrammar_cannot_compile_goes_to_llguidance():
    assert backend(json={"type": "string", "pattern": "^\\p{L}+$"}) == "llguidance"


@pytest.mark.parametrize("schema,named", [
    ({"type": "integer", "not": {"const": 3}}, "not"),
    ({"type": "integer", "if": {"minimum": 0}, "then": {"minimum": 3}}, "if"),
    ({"type": "array", "contains": {"const": 1}}, "contains"),
    ({"type": "array", "items": INT, "uniqueItems": True}, "uniqueItems"),
    ({"type": "object", "properties": {"a": INT, "b": INT}, "dependentRequired": {"a": ["b"]}},
     "dependentRequired"),
    ({"type": "string", "pattern": "^(?=.*x)[a-z]{3}$"}, "look-around"),
    ({"type": "object", "patternProperties": {"^(?!x)": INT}}, "look-around"),
    ({"type": "object", "properties": {"deep": {"type": "array", "items": {"not": INT}}}}, "not"),
], ids=["not", "if-then", "contains", "uniqueItems", "dependentRequired", "pattern-lookahead",
        "patternProperties-lookahead", "nested"])
def test_what_neither_library_enforces_is_refused_by_name(schema, named):
    with pytest.raises(InvalidParameter) as info:
        build_grammar(StructuredOutputsParams(json=schema))
    assert named in str(info.value) and info.value.param == "structured_outputs"


def test_a_regex_with_look_around_is_refused():
    with pytest.raises(InvalidParameter, match="look-around"):
        build_grammar(StructuredOutputsParams(regex="(?=a)ab"))
    assert backend(regex="ab+") == "xgrammar"


class _ByteTokenizer:
    """One token per byte, then a stop token: llguidance sees every string."""
    EOS = 256
    eos_token_id, bos_token_id, special_token_ids = EOS, None, [EOS]
    tokens = [bytes([b]) for b in range(256)] + [b"<eos>"]

    def __call__(self, text):
        return list(text if isinstance(text, bytes) else text.encode())


BYTES = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokenizer()), n_vocab=257,
                               eos_token=[_ByteTokenizer.EOS])


def llguidance_accepts(grammar: str, text: str) -> bool:
    matcher = LLGuidanceMatcher(BYTES, grammar)
    return all(matcher.accept_token(b) for b in text.encode()) \
        and matcher.accept_token(_ByteTokenizer.EOS)


def test_llguidance_enforces_every_schema_of_an_allof():
    grammar = build_grammar(StructuredOutputsParams(json=A_AND_B)).grammar
    assert llguidance_accepts(grammar, '{"a": 1, "b": 2}')
    assert not llguidance_accepts(grammar, '{"a": 1}')
    assert not llguidance_accepts(grammar, '{"b": 2}')
    assert not llguidance_accepts(grammar, '{"a": 1, "b": "x"}')


def test_both_libraries_write_the_same_compact_json():
    schema = {"type": "object", "properties": {"a": INT, "b": {"type": "array", "items": INT}},
              "required": ["a", "b"]}
    text = json.dumps({"a": 1, "b": [2, 3]})  # ", " and ": ", nothing else
    xgrammar_grammar = build_grammar(StructuredOutputsParams(json=schema)).grammar
    forced = StructuredOutputsParams(json={"allOf": [schema, {"type": "object"}]})
    llguidance_grammar = build_grammar(forced).grammar
    for variant, ok in ((text, True), (text.replace(", ", ","), False),
                        (text.replace(": ", ":"), False), (text.replace("{", "{ "), False)):
        assert xgrammar_accepts(xgrammar_grammar, variant) is ok, variant
        assert llguidance_accepts(llguidance_grammar, variant) is ok, variant


def test_the_llguidance_matcher_rolls_back_like_xgrammars():
    grammar = build_grammar(StructuredOutputsParams(json=A_AND_B)).grammar
    matcher = LLGuidanceMatcher(BYTES, grammar)
    text = b'{"a": 1, "b": 2}'
    assert all(matcher.accept_token(b) for b in text)
    assert not matcher.accept_token(ord("x"))  # refused: the matcher is unchanged
    assert matcher.accept_token(_ByteTokenizer.EOS) and matcher.is_terminated()
    assert not matcher.accept_token(_ByteTokenizer.EOS)  # nothing after the end
    matcher.rollback(2)  # the stop token and "}"
    assert not matcher.is_terminated()
    assert not matcher.accept_token(_ByteTokenizer.EOS)  # the object is open again
    assert matcher.accept_token(ord("}")) and matcher.accept_token(_ByteTokenizer.EOS)
