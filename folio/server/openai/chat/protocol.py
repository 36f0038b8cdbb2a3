"""The body of POST /v1/chat/completions: messages, sampling (shared with completions), tools."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from folio.sampling_params import INT64_MAX, MAX_LOGPROBS
from folio.server.errors import APIError
from folio.server.openai.chat.messages import ChatMessage
from folio.server.openai.protocol import SamplingFields
from folio.server.request_body import StrictModel
from folio.tool_calls.types import FunctionTool

MAX_TOOLS = 128  # as OpenAI


class FunctionDefinition(StrictModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # folio enforces schemas only for required and named choices


class ToolParam(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class ChosenFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: ChosenFunction


class ChatCompletionRequest(SamplingFields):
    _unsupported = (
        "functions", "function_call", "modalities", "audio", "prediction", "reasoning_effort", "web_search_options",
    )  # fmt: skip

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # further template variables, e.g. enable_thinking
    tools: list[ToolParam] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: Any = None
    function_call: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools must have different names")
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("tool_choice 'required' or a named function needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names '{self.tool_choice.function.name}', which is not among the tools")
        return self

    @property
    def completion_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def offered_tools(self) -> list[FunctionTool]:
        """The tools the model is shown: none when tool_choice is 'none' (it could not call them)."""
        if self.tool_choice == "none":
            return []
        return [FunctionTool(t.function.name, t.function.description, t.function.parameters or
                             {"type": "object", "properties": {}}) for t in self.tools or []]  # fmt: skip

    @property
    def named_tool(self) -> str | None:
        return self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None

    @property
    def tool_call_forced(self) -> bool:
        """The answer must be tool calls ('required' or a named function), enforced by a grammar."""
        return self.tool_choice == "required" or self.named_tool is not None


def chat_request_from(fields: dict[str, Any]) -> ChatCompletionRequest:
    """The chat request another API's body translates into (Ollama, Anthropic, Responses); a value that
    fails the chat request's checks is a 400 naming where it failed."""
    try:
        return ChatCompletionRequest(**fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise APIError(400, f"{where}: {first['msg']}" if where else str(first["msg"])) from None
