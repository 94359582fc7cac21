"""Structural tags (vLLM's `structural_tag`): free text until a trigger, then `begin`, a value
of the structure's format (a JSON schema, usually: a tool call's arguments), `end`, and free
text again. Pure: no torch.

Two shapes are read, as vLLM reads them:
- the older one, {"type": "structural_tag", "structures": [{"begin", "schema", "end"}, ...],
  "triggers": [...]}, where each trigger is a prefix of some structure's `begin`;
- xgrammar's newer one, {"type": "structural_tag", "format": {...}} (its format tree:
  triggered_tags, tag, json_schema, sequence, or, regex, grammar, any_text, ...).
The older shape becomes the newer one (a `triggered_tags` format), so one canonical JSON text
(sorted keys, as a JSON schema is kept) is the spec's identity, its cache key and its wire form.

The shape is checked here, the format tree in structural_tag_checks.py (it needs xgrammar's
models, and this module stays import-light: the params import it).
"""
from __future__ import annotations

import json
from typing import Any

from deepinfer.invalid_parameter import InvalidParameter

_NAME = "structural_tag"
# A small model left free to emit whitespace inside JSON can loop on it until max_tokens: the
# older shape (which has no field for it) gets at most one whitespace character at a time, as
# close to the compact JSON of the `json` constraint as xgrammar's structural tags allow.
LEGACY_MAX_WHITESPACE = 1


def bad(message: str) -> InvalidParameter:
    return InvalidParameter("structured_outputs", message)


def canonical_structural_tag(value: Any) -> str:
    """A structural tag (JSON text or an object, either shape) as canonical JSON text of the
    newer shape; InvalidParameter naming the field that is wrong."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise bad(f"{_NAME} must be a JSON object (or its JSON text)") from None
    if not isinstance(value, dict):
        raise bad(f"{_NAME} must be a JSON object (or its JSON text)")
    if value.get("type") != "structural_tag":
        raise bad(f'{_NAME}.type must be "structural_tag"')
    if "format" in value:
        _only_keys(value, ("type", "format"), _NAME)
        tag = {"type": "structural_tag", "format": value["format"]}
    elif "structures" in value or "triggers" in value:
        tag = _from_legacy(value)
    else:
        raise bad(f"{_NAME} needs `format` (xgrammar's shape) or `structures` and `triggers`")
    return json.dumps(tag, sort_keys=True, separators=(",", ":"))


def _from_legacy(value: dict) -> dict:
    _only_keys(value, ("type", "structures", "triggers"), _NAME)
    structures, triggers = value.get("structures"), value.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise bad(f"{_NAME}.structures must be a non-empty list of objects")
    tags = []
    for i, item in enumerate(structures):
        where = f"{_NAME}.structures[{i}]"
        if not isinstance(item, dict):
            raise bad(f"{where} must be an object with begin, schema and end")
        _only_keys(item, ("begin", "schema", "end"), where)
        begin, end = item.get("begin"), item.get("end")
        if not isinstance(begin, str) or not begin:
            raise bad(f"{where}.begin must be a non-empty string")
        if not isinstance(end, str):
            raise bad(f"{where}.end must be a string")
        if "schema" not in item:
            raise bad(f"{where}.schema is required (a JSON schema)")
        schema = item["schema"]
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError:
                raise bad(f"{where}.schema is not valid JSON") from None
        if not isinstance(schema, (dict, bool)):
            raise bad(f"{where}.schema: a JSON schema must be an object")
        tags.append({"type": "tag", "begin": begin, "end": end, "content": {
            "type": "json_schema", "json_schema": schema,
            "max_whitespace_cnt": LEGACY_MAX_WHITESPACE}})
    check_triggers(triggers, [t["begin"] for t in tags], f"{_NAME}.triggers")
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": triggers,
                                                  "tags": tags}}


def _only_keys(node: dict, allowed: tuple[str, ...], where: str) -> None:
    extra = sorted(str(k) for k in node if k not in allowed)
    if extra:
        raise bad(f"{where} has unknown field(s) {', '.join(extra)[:200]} "
                   f"(expected {', '.join(allowed)})")


def check_triggers(triggers: Any, begins: list, where: str) -> None:
    if not isinstance(triggers, list) or not triggers or not all(
            isinstance(t, str) and t for t in triggers):
        raise bad(f"{where} must be a non-empty list of non-empty strings")
    strings = [b for b in begins if isinstance(b, str)]
    for i, trigger in enumerate(triggers):
        if not any(b.startswith(trigger) for b in strings):
            raise bad(f"{where}[{i}] ({trigger[:50]!r}) is not a prefix of any begin")
    for begin in strings:
        if not any(begin.startswith(t) for t in triggers):
            raise bad(f"{where}: the begin {begin[:50]!r} starts with no trigger")
