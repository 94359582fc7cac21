"""Request field types: the JSON Schema states what the strict models accept (2.0 is an
integer, "2" / true / 2.5 are not), and /openapi.json carries the served vocabulary's bound."""
from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from deepinfer.server.api_server import ServerConfig, build_app
from deepinfer.server.protocol import CompletionRequest
from deepinfer.server.request_schema import below_regex
from tests.unit.fake_engine_client import VOCAB, FakeEngineClient


def test_integral_floats_are_integers_and_other_non_integers_are_refused():
    request = CompletionRequest.model_validate_json('{"prompt": [1.0, 2], "n": 2.0, "seed": 5.0}')
    assert request.prompt == [1, 2] and request.n == 2 and request.seed == 5
    assert all(type(v) is int for v in (*request.prompt, request.n, request.seed))
    for bad in ('"2"', "true", "2.5"):
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate_json(f'{{"prompt": "x", "n": {bad}}}')
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate_json('{"prompt": [1, -1]}')


def test_openapi_bounds_token_ids_by_the_served_vocabulary():
    schema = build_app(FakeEngineClient(), ServerConfig()).openapi()
    props = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    ids = props["prompt"]["anyOf"][2]["items"]
    assert (ids["minimum"], ids["maximum"], ids["type"]) == (0, VOCAB - 1, "integer")
    assert "x-token-id" not in str(schema) and "'ge'" not in str(schema)
    keys = props["logit_bias"]["anyOf"][0]["propertyNames"]["pattern"]
    assert re.match(keys, str(VOCAB - 1)) and not re.match(keys, str(VOCAB))


@pytest.mark.parametrize("limit", [1, 2, 10, 11, 100, 49152, 151936])
def test_below_regex_matches_exactly_the_ids_below_the_limit(limit):
    pattern = re.compile(below_regex(limit))
    top = min(limit * 2 + 20, 400000)
    assert [i for i in range(top) if pattern.match(str(i))] == list(range(limit))
    assert not any(pattern.match(s) for s in ("-1", "01", "00", "", "1a"))
