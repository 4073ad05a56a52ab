"""What a request's output must match: vLLM's `StructuredOutputsParams` (one of `json`, `regex`, `choice`,
`grammar`, `json_object`), and its translation to a grammar for llguidance (see hotswap/engine/grammar.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of: `json` (a JSON schema, as a dict or its JSON text), `regex` (Rust regex syntax, matched in
    full), `choice` (one of these strings), `grammar` (GBNF / EBNF as llama.cpp writes it, or Lark), `json_object`
    (any JSON object). `disable_any_whitespace` makes JSON outputs compact (no whitespace outside strings);
    `disable_additional_properties` closes objects whose schema leaves `additionalProperties` unset. The output
    ends when the grammar is complete (the engine then allows only EOS) or at max_tokens (possibly cut short).
    Invalid values raise ValueError naming the field."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs needs exactly one of {', '.join(KINDS)}; got {', '.join(given) or 'none'}"
            )
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(
                f"structured_outputs.json must be a JSON schema (object or text), got {type(self.json).__name__}"
            )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None and (
            not isinstance(self.choice, (list, tuple))
            or not self.choice
            or not all(isinstance(c, str) for c in self.choice)
        ):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError("structured_outputs.json_object must be true or false")

    @classmethod
    def of(cls, value: StructuredOutputsParams | dict[str, Any]) -> StructuredOutputsParams:
        """From itself or a dict with vLLM's field names (unknown fields are refused, naming them)."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs must be an object, got {type(value).__name__}")
        known = {
            *KINDS,
            "disable_any_whitespace",
            "disable_additional_properties",
            "backend",
            "disable_fallback",
            "whitespace_pattern",
        }
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"structured_outputs has unknown field(s) {unknown}; known: {sorted(known)}")
        if value.get("whitespace_pattern") is not None:
            raise ValueError("structured_outputs.whitespace_pattern is not supported; use disable_any_whitespace")
        return cls(**{k: v for k, v in value.items() if k not in ("backend", "disable_fallback", "whitespace_pattern")})

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema this asks for (json_object: any object), None for the other kinds."""
        if self.json_object:
            schema: dict[str, Any] = {"type": "object"}
        elif self.json is None:
            return None
        elif isinstance(self.json, str):
            try:
                schema = json.loads(self.json)
            except json.JSONDecodeError as err:
                raise ValueError(f"structured_outputs.json is not valid JSON: {err}") from None
        else:
            schema = self.json
        if not isinstance(schema, dict):
            raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
        return schema

    def grammar_source(self) -> tuple[str, str]:
        """(llguidance format, text) for `llguidance.grammar_from`."""
        schema = self.schema()
        if schema is not None:
            if self.disable_additional_properties:
                schema = closed(schema)
            guidance: dict[str, Any] = {"whitespace_flexible": not self.disable_any_whitespace}
            if not self.disable_any_whitespace:
                guidance["whitespace_pattern"] = r"[ \n]{0,2}"  # a bounded run: a model cannot loop on spaces
            return "json_schema", json.dumps({**schema, "x-guidance": {**schema.get("x-guidance", {}), **guidance}})
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(list(self.choice))
        assert self.grammar is not None
        return "grammar", self.grammar

    def key(self) -> str:
        """A cache key: equal for requests that compile to the same grammar."""
        return json.dumps(self.grammar_source())


def closed(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` on every object schema that leaves it unset."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out
