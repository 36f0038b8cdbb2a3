"""How a server reads chat answers: which tool-call format, and whether to split out reasoning."""

from __future__ import annotations

from dataclasses import dataclass

from folio.reasoning import REASONING_CHOICES
from folio.tool_calls.registry import PARSER_CHOICES


@dataclass(frozen=True)
class ChatOptions:
    tool_call_parser: str = "auto"  # auto: from the chat template (folio's own prompt if it shows no tools)
    reasoning_parser: str = "auto"  # auto: split <think> when the chat template mentions it

    def __post_init__(self) -> None:
        if self.tool_call_parser not in PARSER_CHOICES:
            raise ValueError(f"unknown tool-call parser {self.tool_call_parser!r}; choose one of "
                             f"{', '.join(PARSER_CHOICES)}")  # fmt: skip
        if self.reasoning_parser not in REASONING_CHOICES:
            raise ValueError(f"unknown reasoning parser {self.reasoning_parser!r}; choose one of "
                             f"{', '.join(REASONING_CHOICES)}")  # fmt: skip
