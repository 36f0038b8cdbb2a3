"""The tool-call formats whose calls are JSON: Hermes/Qwen `<tool_call>` blocks (also folio's own
prompt for templates that cannot show tools), Llama 3.x JSON, Mistral `[TOOL_CALLS]`, and plain JSON."""

from __future__ import annotations

from typing import ClassVar

from folio.tool_calls.base import ToolCallFormat, call_from_object, calls_from_objects, json_values
from folio.tool_calls.types import ToolCall


def _listed(values: list) -> list:
    """A lone JSON list holds the calls; otherwise each value is one call."""
    return values[0] if len(values) == 1 and isinstance(values[0], list) else values


def _listed_calls(text: str, known: frozenset[str]) -> list[ToolCall] | None:
    values = json_values(text)
    return None if values is None else calls_from_objects(_listed(values), known)


class HermesFormat(ToolCallFormat):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call (Hermes, Qwen), or a
    JSON list of calls in one block (SmolLM2's training format)."""

    name: ClassVar[str] = "hermes"
    markers: ClassVar[tuple[str, ...]] = ("<tool_call>",)
    closing: ClassVar[str | None] = "</tool_call>"

    def parse_section(self, section: str, known: frozenset[str]) -> list[ToolCall] | None:
        return _listed_calls(section.removeprefix("<tool_call>").removesuffix("</tool_call>"), known)


class Llama3JsonFormat(ToolCallFormat):
    """Llama 3.1-3.3: the answer is `{"name": ..., "parameters": {...}}` (several joined by `;`),
    optionally after `<|python_tag|>`."""

    name: ClassVar[str] = "llama3_json"
    markers: ClassVar[tuple[str, ...]] = ("<|python_tag|>",)
    leading: ClassVar[str] = "{"

    def parse_section(self, section: str, known: frozenset[str]) -> list[ToolCall] | None:
        values = json_values(section.removeprefix("<|python_tag|>"), separators=";")
        return calls_from_objects(values, known) if values else None


class MistralFormat(ToolCallFormat):
    """`[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or from tokenizer v11 on,
    `[TOOL_CALLS]name[ARGS]{...}` once per call."""

    name: ClassVar[str] = "mistral"
    markers: ClassVar[tuple[str, ...]] = ("[TOOL_CALLS]",)

    def parse_section(self, section: str, known: frozenset[str]) -> list[ToolCall] | None:
        calls: list[ToolCall] = []
        for piece in section.split("[TOOL_CALLS]")[1:]:
            found = self._piece(piece.strip(), known)
            if found is None:
                return None
            calls.extend(found)
        return calls

    @staticmethod
    def _piece(piece: str, known: frozenset[str]) -> list[ToolCall] | None:
        if piece.startswith("["):
            return _listed_calls(piece, known)
        name, _, arguments = piece.partition("[ARGS]") if "[ARGS]" in piece else piece.partition("{")
        values = json_values(arguments if "[ARGS]" in piece else "{" + arguments)
        if values is None or len(values) != 1:
            return None
        call = call_from_object({"name": name.strip(), "arguments": values[0]}, known)
        return None if call is None else [call]


class JsonFormat(ToolCallFormat):
    """The fallback: an answer that is a call object, a list of them, or `{"tool_calls": [...]}`."""

    name: ClassVar[str] = "json"
    leading: ClassVar[str] = "{["

    def parse_section(self, section: str, known: frozenset[str]) -> list[ToolCall] | None:
        values = json_values(section)
        if values is None:
            return None
        if len(values) == 1 and isinstance(values[0], dict) and isinstance(values[0].get("tool_calls"), list):
            values = values[0]["tool_calls"]
        values = _listed(values)
        # OpenAI-shaped entries nest the call under "function".
        values = [v["function"] if isinstance(v, dict) and isinstance(v.get("function"), dict) else v for v in values]
        return calls_from_objects(values, known) if values else None
