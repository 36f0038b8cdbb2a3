"""Pythonic tool calls (Llama 3.2 small models, Llama 4, ToolACE): `[get_weather(city="Paris"), ...]`.

Parsed with Python's own parser, never evaluated: only calls of offered tools with keyword arguments
whose values are literals (JSON's true/false/null are accepted as well)."""

from __future__ import annotations

import ast
from typing import Any, ClassVar

from folio.tool_calls.base import ToolCallFormat, call_from_object
from folio.tool_calls.types import ToolCall

_JSON_NAMES = {"true": True, "false": False, "null": None}


def _literal(node: ast.expr) -> Any:
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.List):
        return [_literal(item) for item in node.elts]
    if isinstance(node, ast.Dict):
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values, strict=True) if k is not None}
    return ast.literal_eval(node)


class PythonicFormat(ToolCallFormat):
    name: ClassVar[str] = "pythonic"
    markers: ClassVar[tuple[str, ...]] = ("<|python_start|>",)
    leading: ClassVar[str] = "["
    closing: ClassVar[str | None] = "<|python_end|>"

    def parse_section(self, section: str, known: frozenset[str]) -> list[ToolCall] | None:
        source = section.removeprefix("<|python_start|>").removesuffix("<|python_end|>").strip()
        try:
            tree = ast.parse(source, mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                return None
            calls = []
            for node in tree.elts:
                if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                    return None
                arguments = {kw.arg: _literal(kw.value) for kw in node.keywords if kw.arg is not None}
                calls.append(call_from_object({"name": node.func.id, "arguments": arguments}, known))
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):  # ast.parse: deep nesting
            return None
        return None if any(c is None for c in calls) else calls  # type: ignore[return-value]
