"""Splitting a streamed answer into prose deltas and whole tool calls as the text arrives.

Prose goes out as soon as it cannot be the start of a call section; a section is held until it closes
(or the answer ends) and then goes out as calls, or as prose if it does not parse. What a stream emits,
joined, equals `ToolCallFormat.parse` of the whole answer (tests/unit/test_tool_call_formats.py checks
this for every way of cutting the text), so no client ever sees half a call as content."""

from __future__ import annotations

from dataclasses import dataclass, field

from folio.tool_calls.base import ToolCallFormat
from folio.tool_calls.types import ToolCall


@dataclass
class StreamPiece:
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


def held_prefix(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that could still grow into a marker."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:size]):
                longest = size
                break
    return longest


class ToolCallStream:
    def __init__(self, fmt: ToolCallFormat, known: frozenset[str]) -> None:
        self.fmt = fmt
        self.known = known
        self._buffer = ""
        self._mode = "start" if fmt.leading else "prose"  # start -> whole | prose <-> section
        self._spaces = ""  # whitespace-only prose, held until something else comes (or the end)
        self._emitted_prose = False
        self.num_calls = 0

    def feed(self, text: str) -> StreamPiece:
        self._buffer += text
        piece = StreamPiece()
        while True:
            if self._mode == "start":
                stripped = self._buffer.lstrip()
                if not stripped:
                    return piece
                self._mode = "whole" if self.fmt.starts_section(stripped) else "prose"
            if self._mode == "whole":
                return piece
            if self._mode == "prose":
                start = self.fmt.next_marker(self._buffer)
                if start < 0:
                    safe = len(self._buffer) - held_prefix(self._buffer, self.fmt.markers)
                    self._prose(piece, self._buffer[:safe])
                    self._buffer = self._buffer[safe:]
                    return piece
                self._prose(piece, self._buffer[:start])
                self._buffer = self._buffer[start:]
                self._mode = "section"
            end = self.fmt.section_end(self._buffer, 0)
            if end is None:
                return piece
            self._section(piece, self._buffer[:end])
            self._buffer = self._buffer[end:]
            self._mode = "prose"

    def finish(self) -> StreamPiece:
        """The rest, once the answer has ended."""
        piece = StreamPiece()
        if self._mode == "whole" or self._mode == "start":
            parsed = self.fmt.parse(self._buffer, self.known)
            self._prose(piece, parsed.content or "")
            self._calls(piece, parsed.tool_calls)
        elif self._mode == "section":
            self._section(piece, self._buffer)
        else:
            self._prose(piece, self._buffer)
        self._buffer = ""
        if self._emitted_prose:
            piece.content += self._spaces
        self._spaces = ""
        return piece

    def _section(self, piece: StreamPiece, section: str) -> None:
        calls = self.fmt.parse_section(section, self.known)
        if calls is None:
            self._prose(piece, section)
        else:
            self._calls(piece, calls)

    def _calls(self, piece: StreamPiece, calls: list[ToolCall]) -> None:
        piece.tool_calls.extend(calls)
        self.num_calls += len(calls)

    def _prose(self, piece: StreamPiece, text: str) -> None:
        if not text:
            return
        if not text.strip():
            self._spaces += text
            return
        piece.content += self._spaces + text
        self._spaces = ""
        self._emitted_prose = True
