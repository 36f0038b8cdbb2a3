"""Reading a chat answer: thinking, tool calls and prose, for a whole answer (`AnswerReader.read`) or
as the text streams (`AnswerStream`). Every API that chats (OpenAI, Ollama, Anthropic, Responses)
reads answers here and only formats the result its own way. Both paths share their parsers, so a
streamed answer splits exactly as the whole one does."""

from __future__ import annotations

from dataclasses import dataclass, field

from folio.reasoning import ReasoningStream, split_reasoning
from folio.tool_calls.base import ToolCallFormat
from folio.tool_calls.forced import parse_forced
from folio.tool_calls.streaming import StreamPiece, ToolCallStream
from folio.tool_calls.types import ToolCall


@dataclass
class AnswerPiece:
    """What a stretch of streamed text turned out to be (any part may be empty)."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class Answer:
    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall]
    finish_reason: str | None


@dataclass(frozen=True)
class AnswerReader:
    tool_format: ToolCallFormat | None = None  # None: tools are not parsed (none offered, or forced)
    known_tools: frozenset[str] = frozenset()
    forced: bool = False  # the answer is the constrained JSON of tool_choice required / named
    named_tool: str | None = None
    reasoning: bool = False
    starts_inside_reasoning: bool = False  # the prompt ended with <think>

    def read(self, text: str, finish_reason: str | None) -> Answer:
        reasoning, content = None, text
        if self.reasoning:
            split = split_reasoning(text, self.starts_inside_reasoning)
            reasoning, content = split.reasoning, split.content
        calls: list[ToolCall] = []
        if self.forced:
            found = parse_forced(content or "", self.named_tool)
            if found is not None:
                calls, content = found, None
        elif self.tool_format is not None:
            parsed = self.tool_format.parse(content or "", self.known_tools)
            calls, content = parsed.tool_calls, parsed.content
        return Answer(reasoning, content, calls, self.finish_reason(finish_reason, bool(calls)))

    def finish_reason(self, engine_reason: str | None, called: bool) -> str | None:
        # OpenAI answers "tool_calls" when the model chose to call, "stop" for a named function.
        return "tool_calls" if called and engine_reason == "stop" and self.named_tool is None else engine_reason

    def stream(self) -> AnswerStream:
        return AnswerStream(self)


class AnswerStream:
    """One choice's answer as its text arrives."""

    def __init__(self, reader: AnswerReader) -> None:
        self.reader = reader
        self.num_calls = 0
        self._reasoning = ReasoningStream(reader.starts_inside_reasoning) if reader.reasoning else None
        use_format = reader.tool_format is not None and not reader.forced
        self._tools = ToolCallStream(reader.tool_format, reader.known_tools) if use_format else None  # type: ignore[arg-type]
        self._forced_text = ""

    def feed(self, text: str) -> AnswerPiece:
        if self._reasoning is None:
            return self._content(text)
        thinking, content = self._reasoning.feed(text)
        return self._join(AnswerPiece(reasoning=thinking), self._content(content))

    def finish(self) -> AnswerPiece:
        piece = AnswerPiece()
        if self._reasoning is not None:
            thinking, content = self._reasoning.finish()
            piece = self._join(AnswerPiece(reasoning=thinking), self._content(content))
        return self._join(piece, self._close())

    @staticmethod
    def _join(first: AnswerPiece, second: AnswerPiece) -> AnswerPiece:
        return AnswerPiece(first.reasoning + second.reasoning, first.content + second.content,
                           first.tool_calls + second.tool_calls)  # fmt: skip

    def _content(self, text: str) -> AnswerPiece:
        if self.reader.forced:  # constrained JSON: read once it is whole
            self._forced_text += text
            return AnswerPiece()
        return AnswerPiece(content=text) if self._tools is None else self._calls(self._tools.feed(text))

    def _close(self) -> AnswerPiece:
        if self.reader.forced:
            calls = parse_forced(self._forced_text, self.reader.named_tool)
            return AnswerPiece(content=self._forced_text) if calls is None else self._calls(StreamPiece("", calls))
        return AnswerPiece() if self._tools is None else self._calls(self._tools.finish())

    def _calls(self, out: StreamPiece) -> AnswerPiece:
        self.num_calls += len(out.tool_calls)
        return AnswerPiece(content=out.content, tool_calls=out.tool_calls)
