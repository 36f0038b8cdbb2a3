"""Chat messages as OpenAI sends them, tool calls and tool results included, and their conversion into
the dicts chat templates read (transformers' shape: a call's arguments as an object, not JSON text)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import field_validator, model_validator

from folio.server.request_body import StrictModel, load_json_text


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class CalledFunction(StrictModel):
    name: str
    arguments: str

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, value: str) -> str:
        try:
            parsed = load_json_text(value)
        except ValueError as exc:
            raise ValueError(f"a tool call's arguments must be a JSON object: {exc}") from None
        if not isinstance(parsed, dict):
            raise ValueError("a tool call's arguments must be a JSON object")
        return value


class MessageToolCall(StrictModel):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # which call a tool message answers
    # An assistant's earlier thinking, as folio sends it; accepted back and not shown to the model,
    # as reasoning models' templates drop it from history.
    reasoning_content: str | None = None
    reasoning: str | None = None
    refusal: str | None = None

    @model_validator(mode="after")
    def _roles(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])

    def as_template_message(self) -> dict[str, Any]:
        # Chat templates know system/user/assistant(/tool); "developer" is OpenAI's new name for system.
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text}
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": load_json_text(c.function.arguments)}}
                for c in self.tool_calls
            ]  # fmt: skip
        if self.role == "tool":
            message["tool_call_id"] = self.tool_call_id
            if self.name is not None:
                message["name"] = self.name
        return message
