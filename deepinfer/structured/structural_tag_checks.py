"""The format tree of a canonical structural tag (structured/structural_tag.py), checked so a
bad spec is an InvalidParameter naming the node that is wrong, never a grammar that quietly
admits more: types strictly by xgrammar's own models, no field they do not name (a typo such
as `exclude` for `excludes` would be dropped without a word), a JSON schema against its
metaschema and refused when it uses a feature xgrammar would not enforce (schema_features.py:
there is no llguidance path for structural tags), a regex with look-around refused, and the
formats that name tokens of one vocabulary refused (the grammar is built without a tokenizer,
before the request is queued).
"""
from __future__ import annotations

import json
import typing
from typing import Any

import jsonschema
import pydantic
from xgrammar import structural_tag as xst

from deepinfer.invalid_parameter import InvalidParameter
from deepinfer.structured.schema_features import has_lookaround, unenforced_by_xgrammar
from deepinfer.structured.structural_tag import check_triggers

_NAME = "structural_tag"
TOKEN_FORMATS = ("token", "exclude_token", "any_tokens", "token_triggered_tags", "token_dispatch")
_FIELDS = {model.model_fields["type"].default: frozenset(model.model_fields)
           for model in typing.get_args(typing.get_args(xst.Format)[0])}


def structural_tag_problem(text: str) -> str | None:
    """What is wrong with a canonical tag's format tree (None: xgrammar may build it): the
    first bad node, by its path. Types are checked strictly (no "1" for 1, no 1 for true)."""
    try:
        xst.StructuralTag.model_validate_json(text, strict=True)
    except pydantic.ValidationError as e:
        error = e.errors(include_url=False)[0]
        at = ".".join(str(p) for p in error["loc"])
        return f"{_NAME}.{at}: {error['msg']}"[:500]
    return _walk(json.loads(text).get("format"), f"{_NAME}.format")


def _walk(node: Any, where: str, default: str | None = None) -> str | None:
    if not isinstance(node, dict):
        return f"{where} must be a format object"
    kind = node.get("type", default)  # a list of tags may leave out their "tag" type
    if kind in TOKEN_FORMATS:
        return (f"{where}: {kind} formats name tokens of one vocabulary and are not supported "
                "(use string begin/end)")
    if kind not in _FIELDS:
        return f"{where}.type must be one of {', '.join(sorted(_FIELDS))} (got {str(kind)[:50]!r})"
    unknown = sorted(str(k) for k in node if k not in _FIELDS[kind])
    if unknown:
        return f"{where} ({kind}) has unknown field(s) {', '.join(unknown)[:200]}"
    problem = _node_problem(kind, node, where)
    if problem is not None:
        return problem
    for key in ("content", "elements", "tags", "rules"):
        children = node.get(key)
        if key == "content":
            children = [children] if children is not None else []
        if not isinstance(children, list):
            continue
        for i, child in enumerate(children):
            path = f"{where}.{key}" if key == "content" else f"{where}.{key}[{i}]"
            if key == "rules":  # (pattern, format) pairs
                if not (isinstance(child, list) and len(child) == 2):
                    return f"{path} must be a [pattern, format] pair"
                child, path = child[1], f"{path}[1]"
            problem = _walk(child, path, "tag" if key == "tags" else None)
            if problem is not None:
                return problem
    return None


def _node_problem(kind: Any, node: dict, where: str) -> str | None:
    if kind == "json_schema" or kind == "qwen_xml_parameter":
        schema = node.get("json_schema")
        problem = metaschema_problem(schema)
        if problem is not None:
            return f"{where}.json_schema: {problem}"
        unenforced = unenforced_by_xgrammar(schema)
        if unenforced:
            return (f"{where}.json_schema uses {', '.join(unenforced)}, which structural tags "
                    "cannot enforce")
    elif kind == "regex":
        if isinstance(node.get("pattern"), str) and has_lookaround(node["pattern"]):
            return f"{where}.pattern uses look-around, which structural tags cannot enforce"
    elif kind == "tag":
        if not isinstance(node.get("begin"), str) or not node["begin"]:
            return f"{where}.begin must be a non-empty string"
    elif kind == "triggered_tags":
        tags = node.get("tags")
        if not isinstance(tags, list) or not tags:
            return f"{where}.tags must be a non-empty list of tag formats"
        begins = [t.get("begin") for t in tags if isinstance(t, dict)]
        try:
            check_triggers(node.get("triggers"), begins, f"{where}.triggers")
        except InvalidParameter as e:
            return str(e)
    return None


def metaschema_problem(schema: Any) -> str | None:
    """Why `schema` is not a JSON schema (checked against its metaschema), or None."""
    if not isinstance(schema, (dict, bool)):
        return "a JSON schema must be an object"
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        at = "/".join(str(p) for p in e.path) or "(root)"
        return f"invalid JSON schema at {at}: {e.message[:300]}"
    return None
