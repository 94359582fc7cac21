"""A bounded schemathesis run over the app's own /openapi.json (every operation, generated
bodies on the real app with an engine stand-in) with every check schemathesis has: no server
error; every status, content type, header and body the server answers with is documented; a
body the schema forbids is refused; and a body the schema allows is accepted.

The schema states every rule it can (bounds, token ids below the served vocabulary, non-empty
lists and strings, reserved template variables; deepinfer/server/request_schema.py). The
rules below it cannot state: each relates two fields, or depends on the served model, the
deployment or a compiler. A 400 naming one of them (its `param` and the start of its message)
is exempt from the acceptance check only; every other check still runs on that response."""
from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import CHECKS, load_all_checks, positive_data_acceptance
from schemathesis.generation import GenerationMode

from deepinfer.server.api_server import ServerConfig, build_app
from tests.unit.fake_engine_client import FakeEngineClient

CONTEXT = "This model's maximum context length"
STRUCTURED = "structured output specs are free-form objects checked by their compiler"
# (param, message start) -> why a schema-valid body is still refused
NOT_STATABLE = {
    ("prompt", CONTEXT): "prompt tokens (after the chat template) vs the model's context",
    ("max_tokens", CONTEXT): "prompt tokens + max_tokens vs the model's context",
    ("suffix", "suffix (fill-in-the-middle) needs"): "FIM needs the tokenizer's FIM tokens",
    ("suffix", "suffix needs text prompts"): "suffix x prompt form",
    ("echo", "echo and suffix"): "echo x suffix",
    ("best_of", "best_of other than n"): "best_of must equal n",
    ("stream_options", "stream_options is only allowed"): "stream_options x stream",
    ("stream_options", "stream_options.continuous_usage_stats is not supported"):
        "vLLM's field, accepted in the schema so that it is refused by name when true",
    ("top_logprobs", "top_logprobs requires"): "top_logprobs x logprobs",
    ("tool_choice", "tool_choice requires tools"): "tool_choice x tools",
    ("tool_choice", '"auto" tool choice requires the server'): "a serve flag (tool parser)",
    ("prompt_logprobs", "prompt_logprobs are not available when"): "prompt_logprobs x stream",
    ("min_tokens", "min_tokens must not exceed"): "min_tokens x max_tokens",
    ("prompt_logprobs", "prompt log-probs"): "prompt log-probs need colocated serving",
    ("echo", "prompt log-probs"): "echo with logprobs needs colocated serving",
    ("continue_final_message", "continue_final_message needs"): "x the last message's role",
    ("max_tokens", "max_tokens must be at least 1 (0 only with echo)"): "max_tokens=0 x echo",
    ("messages", "Cannot apply the chat template"): "the model's chat template decides",
    ("tools", "tools["): "unique function names; parameters a valid JSON schema",
    ("guided_json", "guided_json:"): STRUCTURED,
    ("guided_regex", "guided_regex:"): STRUCTURED,
    ("guided_grammar", "guided_grammar:"): STRUCTURED,
    ("response_format", "response_format"): STRUCTURED,
    ("structured_outputs", "structured_outputs"): STRUCTURED,
}
ONE_CONSTRAINT = "only one structured output constraint"  # param: whichever came second
# The per-request caps (prompts x n, stop strings, messages, content parts, JSON depth, ...)
# are serve flags and mostly span several fields: one error code, `limit_exceeded`
# (server/request_limits.py), whatever the field.
LIMITS = "a per-request cap set by a serve flag (request_limits.py)"


def not_statable(response) -> str | None:
    """The reason a schema-valid body got this 400, when it is one of NOT_STATABLE's."""
    if response.status_code != 400:
        return None
    info = response.json()["error"]
    if info["message"].startswith(ONE_CONSTRAINT):
        return STRUCTURED
    if info.get("code") == "limit_exceeded":
        return LIMITS
    return next((why for (param, start), why in NOT_STATABLE.items()
                 if info["param"] == param and info["message"].startswith(start)), None)


load_all_checks()
ALL_CHECKS = CHECKS.get_all()
assert positive_data_acceptance in ALL_CHECKS
schema = schemathesis.openapi.from_asgi("/openapi.json",
                                        build_app(FakeEngineClient(), ServerConfig()))
negative_schema = schemathesis.openapi.from_asgi("/openapi.json",
                                                 build_app(FakeEngineClient(), ServerConfig()))
negative_schema.config.generation.update(modes=[GenerationMode.NEGATIVE])


@schema.parametrize()
@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
def test_every_operation_answers_as_documented(case):
    response = case.call()
    exempt = [positive_data_acceptance] if not_statable(response) else []
    case.validate_response(response, checks=ALL_CHECKS, excluded_checks=exempt)


@negative_schema.parametrize()
@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
def test_schema_violating_bodies_are_refused(case):
    case.call_and_validate(checks=ALL_CHECKS)


def test_the_exemption_is_narrow():
    """An unlisted 400 on a schema-valid body is not exempt: the acceptance check judges it."""
    class Answer:
        status_code = 400

        def __init__(self, param, message, code=None):
            self.body = {"error": {"param": param, "message": message, "code": code}}

        def json(self):
            return self.body
    assert not_statable(Answer("prompt", f"{CONTEXT} is 64 tokens.")) is not None
    assert not_statable(Answer("prompt", "Token id 5 is out of vocabulary")) is None
    assert not_statable(Answer("n", f"{CONTEXT} is 64 tokens.")) is None
    assert not_statable(Answer("prompt", "prompts x n = 1280 sequences exceeds the limit",
                               "limit_exceeded")) == LIMITS
