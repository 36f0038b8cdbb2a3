"""`tool_choice: "required"` or a named function, enforced whatever the model: the answer is constrained
by a JSON-schema grammar built from the tools' own parameter schemas, so every call parses and
validates. The constrained answer is plain JSON (not the model's own call format): a list of
{"name", "arguments"} objects for `required`, the arguments object itself for a named function."""

from __future__ import annotations

import json
from typing import Any

from folio.tool_calls.types import FunctionTool, ToolCall


def closed_arguments(parameters: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameter schema without room for arguments it does not declare (unless it asks for
    them): a function called with an unknown keyword fails, so a forced call never invents one."""
    if parameters.get("type") == "object" and "properties" in parameters and "additionalProperties" not in parameters:
        return {**parameters, "additionalProperties": False}
    return parameters


def forced_schema(tools: list[FunctionTool], named: str | None, parallel: bool) -> dict[str, Any]:
    if named is not None:
        return closed_arguments(next(t.parameters for t in tools if t.name == named))
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": closed_arguments(t.parameters)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def parse_forced(text: str, named: str | None) -> list[ToolCall] | None:
    """The calls in a constrained answer; None if it does not parse (cut short by max_tokens)."""
    try:
        value = json.loads(text)
        if named is not None:
            return [ToolCall.from_value(named, value)] if isinstance(value, dict) else None
        if not isinstance(value, list):
            return None
        return [ToolCall.from_value(item["name"], item["arguments"]) for item in value]
    except (ValueError, RecursionError):  # json recurses both ways: the grammar bounds no depth
        return None
