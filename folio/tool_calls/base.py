"""How a tool-call format is recognised in a model's text, and the parse that both the whole-answer and
the streaming paths share, so that a streamed answer splits exactly as the whole one does.

A format's calls live in *sections*. A section starts at one of the format's `markers` (such as
`<tool_call>`), or, for formats whose calls are the whole answer (Llama 3's bare JSON, pythonic lists),
when the answer's first non-space character is one of `leading`. A section runs to the format's
`closing` marker (after which prose may resume), or to the end of the answer. A section that does not
parse as calls of the offered tools stays prose: text is never lost.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from typing import Any, ClassVar

from folio.tool_calls.types import ParsedOutput, ToolCall


class ToolCallFormat(ABC):
    name: ClassVar[str]
    markers: ClassVar[tuple[str, ...]] = ()
    leading: ClassVar[str] = ""
    closing: ClassVar[str | None] = None

    @abstractmethod
    def parse_section(self, section: str, known: frozenset[str]) -> list[ToolCall] | None:
        """The calls in one section (marker and closing included), or None if it is not calls of the
        tools named in `known`."""

    def starts_section(self, text: str) -> bool:
        """Whether an answer beginning with `text` (already past its leading spaces) is one section."""
        return bool(self.leading) and text[:1] in self.leading

    def next_marker(self, text: str, start: int = 0) -> int:
        """Where the first marker at or after `start` begins (-1: none)."""
        found = [i for i in (text.find(m, start) for m in self.markers) if i >= 0]
        return min(found, default=-1)

    def section_end(self, text: str, start: int) -> int | None:
        """The end of the section starting at `start` (just past its closing marker), or None while it is
        still open (no closing marker yet, or a format whose sections run to the end)."""
        if self.closing is None:
            return None
        end = text.find(self.closing, start + 1)
        return None if end < 0 else end + len(self.closing)

    def parse(self, text: str, known: frozenset[str]) -> ParsedOutput:
        """A whole answer, split into prose and calls."""
        stripped = text.lstrip()
        if self.starts_section(stripped):
            calls = self.parse_section(stripped, known)
            return ParsedOutput.of(text) if calls is None else ParsedOutput.of("", calls)
        prose: list[str] = []
        calls: list[ToolCall] = []
        position = 0
        while (start := self.next_marker(text, position)) >= 0:
            prose.append(text[position:start])
            end = self.section_end(text, start) or len(text)
            found = self.parse_section(text[start:end], known)
            if found is None:
                prose.append(text[start:end])
            else:
                calls.extend(found)
            position = end
        prose.append(text[position:])
        return ParsedOutput.of("".join(prose), calls)


def call_from_object(item: Any, known: frozenset[str]) -> ToolCall | None:
    """A call from {"name": ..., "arguments" | "parameters": {...}}; None for any other shape, or a tool
    that was not offered."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str) or item["name"] not in known:
        return None
    arguments = item.get("arguments", item.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):  # json.loads recurses: a model can nest past the limit
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall.from_value(item["name"], arguments)


def calls_from_objects(items: list[Any], known: frozenset[str]) -> list[ToolCall] | None:
    try:
        calls = [call_from_object(item, known) for item in items]
    except RecursionError:  # arguments that json.loads took at the edge of the limit, written back out
        return None
    return None if any(c is None for c in calls) else calls  # type: ignore[return-value]


def json_values(text: str, separators: str = "") -> list[Any] | None:
    """The JSON values written one after another in `text`, with whitespace and any of `separators`
    between them; None if anything else is there."""
    decoder = json.JSONDecoder()
    values: list[Any] = []
    position = 0
    while True:
        while position < len(text) and (text[position].isspace() or text[position] in separators):
            position += 1
        if position == len(text):
            return values
        try:
            value, position = decoder.raw_decode(text, position)
        except (ValueError, RecursionError):  # the decoder recurses: a model can nest deeper than Python allows
            return None
        values.append(value)
