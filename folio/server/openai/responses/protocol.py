"""The body of OpenAI's Responses API (POST /v1/responses), stateless, and its conversion into the chat
request folio's chat pipeline runs.

folio stores nothing: `store` is accepted and nothing is kept, so `previous_response_id`, item references
and conversations (which need the stored items) are a 400, as are tools other than functions (web
search, file search, ...) and input that is not text."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from folio.sampling_params import INT64_MAX, MAX_LOGPROBS
from folio.server.errors import APIError
from folio.server.request_body import RequestBody, StrictModel

LOGPROBS_INCLUDE = "message.output_text.logprobs"
HARMLESS_INCLUDES = {LOGPROBS_INCLUDE, "reasoning.encrypted_content"}  # the latter: folio encrypts nothing


class FunctionToolParam(StrictModel):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(StrictModel):
    type: Literal["function"]
    name: str


class TextFormat(StrictModel):
    model_config = ConfigDict(populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(StrictModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # refused: a prompt's length is the model's own


class ReasoningConfig(StrictModel):
    effort: str | None = None  # refused: no effort levels here
    summary: str | None = None  # refused: thinking comes back whole, as reasoning_text
    generate_summary: str | None = None


class ResponsesRequest(RequestBody):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[FunctionToolParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    include: list[str] | None = None
    # Accepted, no effect: nothing is stored, one machine serves, and the prefix cache needs no key.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    stream_options: dict[str, Any] | None = None
    truncation: Literal["disabled"] | None = None  # "auto" (dropping input to fit) is refused
    # Refused: they need stored state, or tools and modes this server does not have.
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    prompt: Any = None
    max_tool_calls: int | None = None
    context_management: Any = None

    def check_supported(self) -> None:
        if self.previous_response_id is not None or self.conversation is not None:
            name = "previous_response_id" if self.previous_response_id is not None else "conversation"
            raise APIError(400, f"'{name}' needs stored responses, and this server stores none: send the whole "
                           "conversation as input", param=name)  # fmt: skip
        for name in ("prompt", "max_tool_calls", "context_management"):
            if getattr(self, name) is not None:
                raise APIError(400, f"'{name}' is not supported by this server", param=name)
        if self.background:
            raise APIError(400, "background responses need stored responses, and this server stores none",
                           param="background")  # fmt: skip
        for name in sorted(set(self.include or []) - HARMLESS_INCLUDES):
            raise APIError(400, f"include '{name}' is not supported by this server", param="include")
        if self.text is not None and self.text.verbosity is not None:
            raise APIError(400, "text.verbosity is not supported by this server", param="text.verbosity")
        if self.reasoning is not None and any(v is not None for v in self.reasoning.model_dump().values()):
            raise APIError(400, "reasoning settings are not supported by this server", param="reasoning")

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or []) or self.top_logprobs is not None

    def chat_fields(self) -> dict[str, Any]:
        """The OpenAI chat request this body asks for."""
        self.check_supported()
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
        else:
            for index, item in enumerate(self.input):
                _add_item(messages, item, index)
        fields: dict[str, Any] = {
            "model": self.model, "messages": messages, "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "stream": self.stream,
            "parallel_tool_calls": self.parallel_tool_calls,
        }  # fmt: skip
        if self.wants_logprobs:
            fields.update(logprobs=True, top_logprobs=self.top_logprobs)
        if self.tools:
            fields["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                               for t in self.tools]  # fmt: skip
        if isinstance(self.tool_choice, FunctionChoice):
            fields["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            fields["tool_choice"] = self.tool_choice
        text_format = self.text.format if self.text is not None else None
        if text_format is not None and text_format.type == "json_object":
            fields["response_format"] = {"type": "json_object"}
        elif text_format is not None and text_format.type == "json_schema":
            schema = {"name": text_format.name or "output", "schema": text_format.schema_ or {}}
            fields["response_format"] = {"type": "json_schema", "json_schema": schema}
        return fields


def _text(content: Any, index: int) -> str:
    """An input message's text: a string, or text parts (input_text / output_text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, "a message's content is a string or a list of parts", param=f"input.{index}.content")
    texts = []
    for number, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise APIError(400, f"content parts of type {kind!r} are not supported by this server: text only",
                           param=f"input.{index}.content.{number}")  # fmt: skip
        texts.append(part["text"])
    return "".join(texts)


def _add_item(messages: list[dict[str, Any]], item: dict[str, Any], index: int) -> None:
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise APIError(400, f"unknown message role {role!r}", param=f"input.{index}.role")
        messages.append({"role": role, "content": _text(item.get("content", ""), index)})
    elif kind == "function_call":
        call = {"id": str(item.get("call_id", "")), "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}  # fmt: skip
        previous = messages[-1] if messages else None
        if previous is not None and previous["role"] == "assistant" and not previous.get("content"):
            previous.setdefault("tool_calls", []).append(call)  # parallel calls: one assistant turn
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output", "")
        messages.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")),
                         "content": output if isinstance(output, str) else _text(output, index)})  # fmt: skip
    elif kind == "reasoning":
        pass  # earlier thinking is not shown to the model, as reasoning models' templates drop it
    else:
        raise APIError(400, f"input items of type {kind!r} are not supported by this server", param=f"input.{index}")
