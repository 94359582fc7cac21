"""A bounded schemathesis run over the app's own /openapi.json (every operation, generated
bodies on the real app with an engine stand-in): no server error, and every status, content
type, header and body the server answers with is one the schema documents.

Schema-level acceptance checks are left out on purpose: rules that need the served model
(its name, the vocabulary, the context length, an empty prompt) are 400s the static schema
cannot state, so "schema-valid request rejected" would flag correct refusals. The other
direction holds and is checked: a body the schema forbids (a string for an integer, `false`
for a token id, a message name that is not a string) is refused, not guessed at."""
from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import (
    content_type_conformance, negative_data_rejection, not_a_server_error,
    response_headers_conformance, response_schema_conformance, status_code_conformance)
from schemathesis.generation import GenerationMode

from deepinfer.server.api_server import ServerConfig, build_app
from tests.unit.fake_engine_client import FakeEngineClient

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_headers_conformance, response_schema_conformance]
schema = schemathesis.openapi.from_asgi("/openapi.json",
                                        build_app(FakeEngineClient(), ServerConfig()))
negative_schema = schemathesis.openapi.from_asgi("/openapi.json",
                                                 build_app(FakeEngineClient(), ServerConfig()))
negative_schema.config.generation.update(modes=[GenerationMode.NEGATIVE])


@schema.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_every_operation_answers_as_documented(case):
    case.call_and_validate(checks=CHECKS)


@negative_schema.parametrize()
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
def test_schema_violating_bodies_are_refused(case):
    case.call_and_validate(checks=[not_a_server_error, negative_data_rejection])
