"""The body of Anthropic's Messages API (POST /v1/messages and /v1/messages/count_tokens), and its
conversion into the OpenAI chat request folio's chat pipeline runs.

Content blocks folio cannot read (images, documents, server tools) are a 400 naming them. `cache_control`
marks are accepted: folio's prefix cache reuses any repeated prefix without being asked."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from folio.sampling_params import INT64_MAX
from folio.server.errors import APIError
from folio.server.request_body import RequestBody, StrictModel


class _Block(StrictModel):
    cache_control: dict[str, Any] | None = None


class TextBlock(_Block):
    type: Literal["text"]
    text: str
    citations: list[Any] | None = None


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False

    @property
    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)
        return f"Error: {text}" if self.is_error else text


class ThinkingBlock(_Block):
    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None


class UnreadableBlock(BaseModel):
    """Blocks of kinds folio cannot read: refused by name rather than dropped."""

    model_config = ConfigDict(extra="allow")
    type: Literal["image", "document", "search_result", "server_tool_use", "web_search_tool_result",
                  "container_upload"]  # fmt: skip


Block = TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | UnreadableBlock


class AnthropicMessage(StrictModel):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class AnthropicTool(StrictModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class AnthropicToolChoice(StrictModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(StrictModel):
    """`enabled` (with a budget), `adaptive` (the model decides) or `disabled`. folio bounds thinking and
    answer together by max_tokens: `budget_tokens` is checked as Anthropic checks it, not enforced apart."""

    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: int | None = Field(None, ge=1)
    display: Literal["summarized", "omitted"] | None = None


class OutputFormat(StrictModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(StrictModel):
    format: OutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # refused: no effort levels here


class CountTokensRequest(RequestBody):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    cache_control: dict[str, Any] | None = None  # folio caches every repeated prefix anyway

    def chat_fields(self) -> dict[str, Any]:
        """The OpenAI chat request fields these messages, system prompt and tools become."""
        messages: list[dict[str, Any]] = []
        if self.system:
            system = self.system if isinstance(self.system, str) else "".join(b.text for b in self.system)
            messages.append({"role": "system", "content": system})
        for number, message in enumerate(self.messages):
            messages.extend(_converted(message, number))
        fields: dict[str, Any] = {"model": self.model, "messages": messages}
        if self.tools:
            fields["tools"] = [
                {
                    "type": "function",
                    "function": {"name": t.name, "description": t.description, "parameters": t.input_schema},
                }
                for t in self.tools
            ]
        if self.tool_choice is not None:
            choice = self.tool_choice
            if choice.type == "tool" and not choice.name:
                raise APIError(400, "tool_choice of type 'tool' needs the tool's name", param="tool_choice")
            named = {"type": "function", "function": {"name": choice.name}} if choice.type == "tool" else None
            fields["tool_choice"] = named or {"auto": "auto", "any": "required", "none": "none"}[choice.type]
            if choice.disable_parallel_tool_use:
                fields["parallel_tool_calls"] = False
        if self.thinking is not None and self.thinking.type != "adaptive":  # adaptive: the template's default
            fields["chat_template_kwargs"] = {"enable_thinking": self.thinking.type == "enabled"}
        if self.output_config is not None:
            if self.output_config.effort is not None:
                raise APIError(
                    400, "output_config.effort is not supported by this server", param="output_config.effort"
                )
            if self.output_config.format is not None:
                schema = self.output_config.format.schema_
                fields["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
        return fields


def _converted(message: AnthropicMessage, number: int) -> list[dict[str, Any]]:
    """One Anthropic message as OpenAI messages: tool results become `tool` messages (before the user's
    own text), tool uses the assistant's `tool_calls`."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    text, calls, results = "", [], []
    for index, block in enumerate(message.content):
        if isinstance(block, UnreadableBlock):
            raise APIError(400, f"'{block.type}' content blocks are not supported by this server",
                           param=f"messages.{number}.content.{index}")  # fmt: skip
        if isinstance(block, TextBlock):
            text += block.text
        elif isinstance(block, ToolUseBlock):
            arguments = json.dumps(block.input, ensure_ascii=False)
            calls.append({"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}})
        elif isinstance(block, ToolResultBlock):
            results.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text})
        # Earlier thinking is not shown to the model, as reasoning models' templates drop it.
    if message.role == "assistant":
        return [{"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}]
    if calls:
        raise APIError(400, "tool_use blocks belong to assistant messages", param=f"messages.{number}.content")
    return results + ([{"role": "user", "content": text}] if text or not results else [])


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1, le=INT64_MAX)
    stop_sequences: list[str] | None = None
    # Older clients send sampling settings; current ones send none (Anthropic's defaults: temperature 1).
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    # Account and routing fields: accepted, no effect (nothing is stored, one machine serves).
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    inference_geo: str | None = None
    workspace_id: str | None = None
    user_profile_id: str | None = None
    speed: Literal["standard"] | None = None  # "fast" is refused: this server has one speed
    container: Any = None
    mcp_servers: Any = None
    diagnostics: Any = None

    def chat_fields(self) -> dict[str, Any]:
        fields = super().chat_fields()
        for name in ("container", "mcp_servers", "diagnostics"):
            if getattr(self, name) is not None:
                raise APIError(400, f"'{name}' is not supported by this server", param=name)
        if self.thinking is not None and self.thinking.type == "enabled":
            budget = self.thinking.budget_tokens
            if budget is None or not 1024 <= budget < self.max_tokens:
                raise APIError(400, "thinking.budget_tokens must be at least 1024 and less than max_tokens",
                               param="thinking.budget_tokens")  # fmt: skip
        return {**fields, "max_tokens": self.max_tokens, "stop": self.stop_sequences or None, "stream": self.stream,
                "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}  # fmt: skip
