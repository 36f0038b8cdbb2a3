"""The pieces of a Responses answer: output items (reasoning, message, function call), usage, and the
response object around them (`ResponseShell`), shared by the whole and the streamed answers."""

from __future__ import annotations

import time
import uuid
from typing import Any

from folio.server.chat_answer import Answer
from folio.server.context import ServerContext
from folio.server.openai.chat.protocol import ChatCompletionRequest
from folio.server.openai.responses.protocol import ResponsesRequest
from folio.tool_calls.types import ToolCall


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id("rs"), "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}  # fmt: skip


def message_item(text: str, logprobs: list[dict[str, Any]], status: str = "completed") -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
    return {"type": "message", "id": item_id("msg"), "role": "assistant", "status": status, "content": [part]}


def call_item(call: ToolCall, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id("fc"), "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": status}  # fmt: skip


class ResponseShell:
    """The response object's fields other than its output, as the request set them."""

    def __init__(self, ctx: ServerContext, body: ResponsesRequest, chat: ChatCompletionRequest) -> None:
        self.id = item_id("resp")
        self.created_at = time.time()
        self.fields = {
            "object": "response", "model": ctx.model_name, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "temperature": chat.temperature, "top_p": chat.top_p,
            "parallel_tool_calls": chat.parallel_tool_calls is not False, "store": False,
            "tool_choice": body.tool_choice.model_dump() if body.tool_choice is not None and
            not isinstance(body.tool_choice, str) else body.tool_choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "text": {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)}
            if body.text is not None and body.text.format is not None else {"format": {"type": "text"}},
            "metadata": body.metadata or {}, "top_logprobs": body.top_logprobs, "truncation": "disabled",
            "previous_response_id": None, "reasoning": None, "user": body.user, "error": None,
        }  # fmt: skip

    def whole(self, output: list[dict[str, Any]], status: str, usage: dict[str, Any] | None) -> dict[str, Any]:
        finished = status != "in_progress"
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "created_at": self.created_at, "completed_at": time.time() if finished else None,
                "status": status, "incomplete_details": incomplete, "output": output, "usage": usage,
                **self.fields}  # fmt: skip


def usage(prompt_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + output_tokens}  # fmt: skip


def output_items(answer: Answer, logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    items = [reasoning_item(answer.reasoning)] if answer.reasoning else []
    if answer.content:
        items.append(message_item(answer.content, logprobs))
    return items + [call_item(call) for call in answer.tool_calls]
