"""What a request constrains its output to (vLLM's StructuredOutputsParams). Pure: no torch.

Exactly one constraint is set. A JSON schema (and a structural tag) travels as canonical JSON
text (sorted keys), so the params cross the engine boundary as plain msgspec data and two
requests with the same spec share one compiled grammar (`key`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from deepinfer.invalid_parameter import InvalidParameter
from deepinfer.structured.structural_tag import canonical_structural_tag

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass
class StructuredOutputsParams:
    json: str | None = None  # a JSON schema, as canonical JSON text (`canonical_schema`)
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # EBNF (xgrammar's dialect, which reads GBNF)
    # free text with tagged structures (structured/structural_tag.py): either of vLLM's shapes
    # in (JSON text or an object), canonical JSON text of xgrammar's shape after
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json, (dict, bool)) or (isinstance(self.json, str) and self.json.strip()):
            try:
                self.json = canonical_schema(self.json)
            except ValueError:
                raise InvalidParameter("structured_outputs",
                                       "json must be a JSON schema (JSON text or an object)") from None
        if self.structural_tag not in (None, False) and not (
                isinstance(self.structural_tag, str) and not self.structural_tag.strip()):
            self.structural_tag = canonical_structural_tag(self.structural_tag)
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)):  # list("ab") would be ["a", "b"]
                raise InvalidParameter("structured_outputs",
                                       "choice must be a non-empty list of non-empty strings")
            self.choice = list(self.choice)
        self._validate()

    def _validate(self) -> None:
        set_kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise InvalidParameter("structured_outputs", "structured outputs take exactly one of "
                                   f"{', '.join(KINDS)} (got {', '.join(set_kinds) or 'none'})")
        if self.choice is not None and (not self.choice or not all(
                isinstance(c, str) and c for c in self.choice)):
            raise InvalidParameter("structured_outputs",
                                   "choice must be a non-empty list of non-empty strings")
        for name in ("json", "regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise InvalidParameter("structured_outputs", f"{name} must be a non-empty string")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple:
        """Hashable identity of the constraint (the compiled-grammar cache key)."""
        kind = self.kind
        value = getattr(self, kind)
        return (kind, tuple(value) if isinstance(value, list) else value)


def canonical_schema(schema) -> str:
    """A schema (dict, or JSON text) as sorted-key JSON text; ValueError if it is not JSON."""
    if isinstance(schema, str):
        schema = json.loads(schema)
    return json.dumps(schema, sort_keys=True, separators=(",", ":"))
