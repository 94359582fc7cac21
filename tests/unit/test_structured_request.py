"""Structured-output request fields (response_format, structured_outputs, guided_*) become
one StructuredOutputsParams in the engine's SamplingParams, on both endpoints; bad or
ambiguous specs are 400s naming the field. Runs the endpoints' request preparation on the
stub engine client of test_api_request_fields (no model)."""
from __future__ import annotations

import json

import msgspec
import pytest

from deepinfer.invalid_parameter import InvalidParameter

from deepinfer.sampling_params import SamplingParams
from deepinfer.server.errors import APIError
from deepinfer.wire.engine_messages import AddRequest
from deepinfer.server.serving_chat import OpenAIServingChat
from deepinfer.server.serving_completion import OpenAIServingCompletion
from deepinfer.structured.params import StructuredOutputsParams
from tests.unit.test_api_request_fields import make, prepare_chat, prepare_completion

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module", params=["chat", "completion"])
def prepare(request):
    if request.param == "chat":
        serving = make(OpenAIServingChat)
        return lambda **fields: prepare_chat(serving, **fields)[1]
    serving = make(OpenAIServingCompletion)
    return lambda **fields: prepare_completion(serving, **fields)[1]


@pytest.mark.parametrize("fields,expected", [
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     {"json": SCHEMA}),
    ({"structured_outputs": {"json": SCHEMA}}, {"json": SCHEMA}),
    ({"structured_outputs": {"regex": "[a-z]+"}}, {"regex": "[a-z]+"}),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, {"choice": ["yes", "no"]}),
    ({"structured_outputs": {"grammar": 'root ::= "a" | "b"'}}, {"grammar": 'root ::= "a" | "b"'}),
    ({"guided_json": json.dumps(SCHEMA)}, {"json": SCHEMA}),
    ({"guided_regex": "[0-9]{3}"}, {"regex": "[0-9]{3}"}),
    ({"guided_choice": ["a", "b"]}, {"choice": ["a", "b"]}),
    ({"guided_grammar": 'root ::= "x"'}, {"grammar": 'root ::= "x"'}),
])
def test_fields_become_the_engine_constraint(prepare, fields, expected):
    spec = prepare(**fields).structured_outputs
    assert spec == StructuredOutputsParams(**expected)


@pytest.mark.parametrize("fields", [{}, {"response_format": {"type": "text"}},
                                    {"guided_json": None}, {"structured_outputs": {}}])
def test_no_constraint(prepare, fields):
    assert prepare(**fields).structured_outputs is None


@pytest.mark.parametrize("fields,param", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "strin"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
     "response_format"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}},
     "guided_json"),
    ({"guided_json": {"minimum": "zero"}}, "guided_json"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"choice": 1.0}}, "structured_outputs"),
    ({"structured_outputs": {"choice": "ab"}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
])
def test_bad_specs_are_400s_naming_the_field(prepare, fields, param):
    with pytest.raises(APIError) as info:
        prepare(**fields)
    assert info.value.status_code == 400 and info.value.info.param == param, info.value.info


def test_an_empty_choice_is_refused_by_the_schema_itself():
    """The published schema states it (minLength 1), so the body fails to parse: a 400."""
    from pydantic import ValidationError

    from deepinfer.server.protocol import CompletionRequest
    for choice in (["a", ""], []):
        with pytest.raises(ValidationError) as info:
            CompletionRequest(prompt="hi", guided_choice=choice)
        assert info.value.errors()[0]["loc"][0] == "guided_choice"


def test_params_cross_the_engine_boundary():
    spec = StructuredOutputsParams(json=SCHEMA)
    message = AddRequest("r", [1, 2], SamplingParams(structured_outputs=spec), 0.0)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(message), type=AddRequest)
    assert decoded.sampling_params.structured_outputs == spec
    assert spec.key() == StructuredOutputsParams(json=json.dumps(SCHEMA, indent=2)).key()


@pytest.mark.parametrize("kwargs", [{}, {"regex": "a", "grammar": "root ::= \"a\""},
                                    {"choice": []}, {"regex": "  "}])
def test_params_hold_exactly_one_constraint(kwargs):
    with pytest.raises(InvalidParameter):
        StructuredOutputsParams(**kwargs)


def test_hostile_sizes_are_400s(prepare):
    deep: dict = {"type": "object"}
    for _ in range(5000):
        deep = {"type": "array", "items": deep}
    for fields, param in (({"guided_json": deep}, "guided_json"),
                          ({"guided_regex": "a" * 70000}, "guided_regex"),
                          ({"guided_choice": ["x" * 1000] * 100}, "guided_choice")):
        with pytest.raises(APIError) as info:
            prepare(**fields)
        assert info.value.status_code == 400 and info.value.info.param == param
