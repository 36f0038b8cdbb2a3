"""The values tool calling passes around: a tool offered to the model, a call the model made, and a
model output split into its text and its calls."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any


def new_call_id() -> str:
    # OpenAI's ids look like "call_" + 24 alphanumerics; clients only echo them back.
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class FunctionTool:
    name: str
    description: str | None = None
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    def as_template_tool(self) -> dict[str, Any]:
        """The shape chat templates expect in their `tools` variable (as transformers passes it)."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object as text, as OpenAI sends it
    id: str = field(default_factory=new_call_id, compare=False)

    @classmethod
    def from_value(cls, name: str, arguments: Any) -> ToolCall:
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        return cls(name, text)

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {"id": self.id, "type": "function",
                                "function": {"name": self.name, "arguments": self.arguments}}  # fmt: skip
        return call if index is None else {"index": index, **call}


@dataclass
class ParsedOutput:
    """A model's answer split into prose and tool calls. `content` is None when no prose is left
    (whitespace only), as OpenAI sends `content: null` beside tool calls."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)

    @classmethod
    def of(cls, content: str, tool_calls: list[ToolCall] | None = None) -> ParsedOutput:
        return cls(content if content.strip() else None, tool_calls or [])
