"""What a request constrains its output to, and the llguidance grammar that says it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import llguidance

# Compact JSON: with free whitespace a small model can pad an object with newlines until max_tokens.
_JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}


@dataclass
class StructuredOutputParams:
    """Exactly one of: a JSON schema, any JSON object, a regex, a list of choices, a Lark grammar."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # llguidance's Lark dialect
    compiled: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = [self.json is not None, self.json_object, self.regex is not None, self.choice is not None,
                 self.grammar is not None]  # fmt: skip
        if sum(given) != 1:
            raise ValueError("structured output takes exactly one of json, json_object, regex, choice, grammar")
        if self.choice is not None and (not self.choice or any(not isinstance(c, str) or not c for c in self.choice)):
            raise ValueError("choice must be a non-empty list of non-empty strings")
        self.compiled = self._grammar()
        error = llguidance.LLMatcher.validate_grammar(self.compiled)
        if error:
            raise ValueError(f"invalid {self.kind}: {error}")

    @property
    def kind(self) -> str:
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return "json schema" if name == "json" else name
        return "json_object"

    def _grammar(self) -> str:
        from_schema = llguidance.LLMatcher.grammar_from_json_schema
        if self.json is not None:
            try:
                schema = json.loads(self.json) if isinstance(self.json, str) else self.json
            except json.JSONDecodeError as exc:
                raise ValueError(f"the json schema is not JSON: {exc}") from exc
            return from_schema(schema, defaults=_JSON_OPTIONS)
        if self.json_object:
            return from_schema({"type": "object"}, defaults=_JSON_OPTIONS)
        if self.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            # JSON string literals are Lark string literals, escapes included.
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choice))
        assert self.grammar is not None
        return llguidance.LLMatcher.grammar_from_lark(self.grammar)
