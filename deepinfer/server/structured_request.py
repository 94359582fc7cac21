"""A request's structured-output fields -> one StructuredOutputsParams, or a 400.

Accepted, as OpenAI and vLLM name them (at most one per request):
- `response_format`: {"type": "text"} (no constraint), {"type": "json_object"},
  {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}, or
  {"type": "structural_tag", ...} in either of vLLM's shapes (structured/structural_tag.py);
- `structured_outputs` (vLLM): {"json" | "regex" | "choice" | "grammar" | "json_object" |
  "structural_tag"} (a structural tag as JSON text, as vLLM passes it, or an object);
- the older vLLM fields `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.

A schema is checked against its JSON Schema metaschema (jsonschema), then every spec is
turned into a grammar (xgrammar, no tokenizer needed), so a spec the grammar library cannot
honour is a 400 naming the field before anything is queued.
"""
from __future__ import annotations

import json
from typing import Any

import jsonschema

from deepinfer.invalid_parameter import InvalidParameter
from deepinfer.server.errors import bad_request
from deepinfer.structured.grammars import build_grammar
from deepinfer.structured.params import StructuredOutputsParams, canonical_schema

_LEGACY_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}
_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# Larger specs are refused: compiling one costs the engine time in proportion to its size.
MAX_SPEC_CHARS = 64 * 1024


def asks_structured_output(request) -> bool:
    """Whether the request sets any structured-output field (without checking it)."""
    fmt = request.response_format
    return bool((fmt and fmt.get("type") != "text") or request.structured_outputs
                or any(getattr(request, name) not in (None, "", [], {}) for name in _LEGACY_FIELDS))


def structured_outputs_for(request) -> StructuredOutputsParams | None:
    """The request's constraint (None: unconstrained); APIError 400 for a bad or ambiguous one."""
    found: list[tuple[str, dict[str, Any]]] = []  # (request field, StructuredOutputsParams kwargs)
    fmt = _response_format(request.response_format)
    if fmt is not None:
        found.append(("response_format", fmt))
    if request.structured_outputs:
        found.append(("structured_outputs", _vllm_structured(request.structured_outputs)))
    for name, kind in _LEGACY_FIELDS.items():
        value = getattr(request, name)
        if value not in (None, "", [], {}):
            found.append((name, {kind: value}))
    if not found:
        return None
    if len(found) > 1:
        raise bad_request(f"only one structured output constraint may be given (got "
                          f"{', '.join(n for n, _ in found)})", param=found[1][0])
    field, kwargs = found[0]
    return _checked(field, kwargs)


def _response_format(fmt: dict[str, Any] | None) -> dict[str, Any] | None:
    if not fmt:
        return None
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise bad_request("response_format.json_schema must be an object with a `schema`",
                              param="response_format")
        if "name" in spec and not isinstance(spec["name"], str):
            raise bad_request("response_format.json_schema.name must be a string",
                              param="response_format")
        return {"json": spec["schema"]}
    if kind == "structural_tag":
        return {"structural_tag": fmt}
    raise bad_request("response_format.type must be one of text, json_object, json_schema, "
                      "structural_tag "
                      f"(got {str(kind)[:50]!r})", param="response_format")


def _vllm_structured(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise bad_request("structured_outputs must be an object", param="structured_outputs")
    kwargs = {}
    for key, item in value.items():
        if key in _STRUCTURED_KEYS:
            if item not in (None, False):
                kwargs[key] = item
        elif item not in (None, False, "", [], {}):  # e.g. whitespace_pattern
            raise bad_request(f"structured_outputs.{key} is not supported by this server",
                              param="structured_outputs", code="unsupported_parameter")
    return kwargs


def _checked(field: str, kwargs: dict[str, Any]) -> StructuredOutputsParams:
    try:
        if "json" in kwargs:
            kwargs["json"] = _checked_schema(field, kwargs["json"])
        spec = StructuredOutputsParams(**kwargs)
        size = len(json.dumps(spec.key()))
        if size > MAX_SPEC_CHARS:
            raise bad_request(f"{field}: the constraint is too large ({size} characters; at "
                              f"most {MAX_SPEC_CHARS})", param=field)
        build_grammar(spec)
    except InvalidParameter as e:
        raise bad_request(f"{field}: {e}", param=field) from None
    except RecursionError:
        raise bad_request(f"{field}: the constraint is nested too deeply", param=field) from None
    return spec


def _checked_schema(field: str, schema: Any) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise bad_request(f"{field}: the JSON schema is not valid JSON", param=field) from None
    if not isinstance(schema, (dict, bool)):
        raise bad_request(f"{field}: a JSON schema must be an object", param=field)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.path) or "(root)"
        raise bad_request(f"{field}: invalid JSON schema at {where}: {e.message[:300]}",
                          param=field) from None
    return canonical_schema(schema)
