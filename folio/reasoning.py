"""Reasoning models think before they answer: `<think>...</think>` text goes to `reasoning_content`
(and `reasoning`), the rest to `content`, whole or streamed.

Two conventions: the answer opens its own `<think>` (Qwen3), or the chat template already ended the
prompt with `<think>` (DeepSeek-R1), so the answer starts inside the thinking. An answer that opened
its thinking and never closed it (cut by max_tokens) is all reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass

from folio.tool_calls.streaming import held_prefix

OPEN, CLOSE = "<think>", "</think>"
REASONING_CHOICES = ("auto", "none", "think", "deepseek_r1", "qwen3")


def reasoning_enabled(choice: str, template: str | None) -> bool:
    """`auto` splits thinking for templates that know about it."""
    if choice not in REASONING_CHOICES:
        raise ValueError(f"unknown reasoning parser {choice!r}; choose one of {', '.join(REASONING_CHOICES)}")
    if choice == "auto":
        return bool(template) and OPEN in template  # type: ignore[operator]
    return choice != "none"


def prompt_opens_thinking(prompt_text: str) -> bool:
    return prompt_text.rstrip().endswith(OPEN)


@dataclass
class SplitAnswer:
    reasoning: str | None
    content: str | None


def split_reasoning(text: str, starts_inside: bool) -> SplitAnswer:
    if not starts_inside:
        stripped = text.lstrip()
        if not stripped.startswith(OPEN):
            return SplitAnswer(None, text)
        text = stripped[len(OPEN) :]
    reasoning, closed, content = text.partition(CLOSE)
    content = content.lstrip()
    return SplitAnswer(reasoning, content if closed and content else None)


class ReasoningStream:
    """Streamed deltas split as `split_reasoning` splits the whole answer."""

    def __init__(self, starts_inside: bool) -> None:
        self._mode = "reasoning" if starts_inside else "start"  # start -> reasoning | content
        self._buffer = ""
        self._content_started = False

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) now safe to send."""
        self._buffer += text
        reasoning = ""
        if self._mode == "start":
            stripped = self._buffer.lstrip()
            if OPEN.startswith(stripped):  # empty, or a tag still arriving
                return "", ""
            if stripped.startswith(OPEN):
                self._mode, self._buffer = "reasoning", stripped[len(OPEN) :]
            else:
                self._mode = "content"
                self._content_started = True
        if self._mode == "reasoning":
            head, closed, tail = self._buffer.partition(CLOSE)
            if not closed:
                safe = len(self._buffer) - held_prefix(self._buffer, (CLOSE,))
                reasoning, self._buffer = self._buffer[:safe], self._buffer[safe:]
                return reasoning, ""
            reasoning, self._buffer, self._mode = head, tail, "content"
        return reasoning, self._content()

    def finish(self) -> tuple[str, str]:
        if self._mode == "start":  # the answer ended while it might still have been opening a tag
            self._mode = "content"
            self._content_started = True
        if self._mode == "reasoning":
            rest, self._buffer = self._buffer, ""
            return rest, ""
        return "", self._content()

    def _content(self) -> str:
        if not self._content_started:
            self._buffer = self._buffer.lstrip()
            self._content_started = bool(self._buffer)
        out, self._buffer = self._buffer, ""
        return out
