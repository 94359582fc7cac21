"""The JSON-Schema features xgrammar accepts but does not enforce.

Checked by compiling schemas with a violating and a conforming instance (xgrammar 0.2.x):
`not`, `if`/`then`/`else`, `contains` (and its min/max), `dependentRequired`,
`dependentSchemas`, `uniqueItems: true`, an `allOf` of more than one schema and a `pattern`
with look-around all compile without a word and then admit outputs the schema forbids. A
schema using any of them goes to llguidance instead, which enforces `allOf` and refuses the
rest by name, so the client gets a 400 rather than an output that silently breaks its schema.
(`oneOf` is enforced as `anyOf` by both libraries: exact for the disjoint alternatives that
discriminated unions produce.)
"""
from __future__ import annotations

import re
from typing import Any

_UNENFORCED_KEYWORDS = ("not", "if", "then", "else", "contains", "minContains", "maxContains",
                        "dependentRequired", "dependentSchemas")
# Keywords whose value maps names to schemas (the names are data, not keywords).
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# Keywords whose value is data, never a schema.
_DATA = ("enum", "const", "default", "examples", "required", "dependentRequired")
_LOOKAROUND = re.compile(r"\(\?(?:=|!|<=|<!)")


def has_lookaround(regex: str) -> bool:
    return bool(_LOOKAROUND.search(regex))


def unenforced_by_xgrammar(schema: Any) -> list[str]:
    """The features of `schema` (parsed JSON) xgrammar would not enforce, sorted."""
    found: set[str] = set()
    _walk(schema, found)
    return sorted(found)


def _walk(node: Any, found: set[str]) -> None:
    if isinstance(node, list):
        for item in node:
            _walk(item, found)
        return
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        if key in _UNENFORCED_KEYWORDS:
            found.add(key)
        elif key == "uniqueItems" and value is True:
            found.add(key)
        elif key == "allOf" and isinstance(value, list) and len(value) > 1:
            found.add("allOf")
        elif key == "pattern" and isinstance(value, str) and has_lookaround(value):
            found.add("pattern (look-around)")
        if key in _DATA:
            continue
        if key in _SCHEMA_MAPS:
            if isinstance(value, dict):
                if key == "patternProperties" and any(map(has_lookaround, value)):
                    found.add("patternProperties (look-around)")
                for sub in value.values():
                    _walk(sub, found)
        else:
            _walk(value, found)
