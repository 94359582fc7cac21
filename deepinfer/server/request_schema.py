"""Request field types whose JSON Schema is exactly what the strict models accept, and the
served model's facts (its vocabulary) written into /openapi.json.

JSON Schema counts `2.0` as an integer, so the integer fields take it (as 2); `"2"`, `true`
and `2.5` stay refused. Token ids are integers in [0, vocab_size): the lower bound is static,
the upper one is the served model's and is filled in when the app builds its schema."""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, Field

TOKEN_ID_MARK = "x-token-id"  # schema nodes whose maximum is the served vocabulary's last id
TOKEN_ID_KEYS_MARK = "x-token-id-keys"  # objects keyed by token ids (as decimal strings)


def _integral(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def integer(**bounds: int) -> Any:
    """An integer field type with `Field` bounds (ge, le, ...). The bounds sit inside, before
    the validator, so that the JSON Schema states them (as minimum / maximum)."""
    return Annotated[int, Field(**bounds), BeforeValidator(_integral)]


Int = integer()
TokenId = Annotated[int, Field(ge=0, json_schema_extra={TOKEN_ID_MARK: True}),
                    BeforeValidator(_integral)]


def below_regex(limit: int) -> str:
    """A regex for the decimal strings of 0 .. limit - 1, no leading zeros (logit_bias keys)."""
    if limit < 1:
        raise ValueError("limit must be at least 1")
    top = str(limit - 1)
    alternatives = ["0"]
    # Shorter numbers than `top`: any digits, no leading zero.
    for length in range(1, len(top)):
        alternatives.append("[1-9]" + "[0-9]" * (length - 1))
    # Same length as `top`: a prefix of top, one smaller digit, then anything.
    for i, digit in enumerate(top):
        low = 1 if i == 0 else 0
        if int(digit) > low:
            rest = len(top) - i - 1
            smaller = f"[{low}-{int(digit) - 1}]" if int(digit) - 1 > low else str(low)
            alternatives.append(top[:i] + smaller + "[0-9]" * rest)
    alternatives.append(top)
    return "^(" + "|".join(dict.fromkeys(alternatives)) + ")$"


def with_served_model(schema: dict, vocab_size: int) -> dict:
    """Fill in the token id bound everywhere the request models mark one (in place)."""
    stack: list[Any] = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if node.pop(TOKEN_ID_MARK, False):
                node["maximum"] = vocab_size - 1
            if node.pop(TOKEN_ID_KEYS_MARK, False):
                node["propertyNames"] = {"pattern": below_regex(vocab_size)}
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return schema
