"""Anthropic's Messages API on folio's chat pipeline: POST /v1/messages (whole, or streamed as
Anthropic's typed server-sent events) and POST /v1/messages/count_tokens. A Messages body becomes the
OpenAI chat request (anthropic/protocol.py), so templates, tools, grammars and the answer reader are the
ones every chat route uses; only the shapes differ."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.concurrency import run_in_threadpool

from folio.reasoning import reasoning_enabled
from folio.server.anthropic.protocol import CountTokensRequest, MessagesRequest
from folio.server.chat_answer import AnswerPiece
from folio.server.context import ServerContext
from folio.server.engine_client.protocol import GenerationStream
from folio.server.errors import APIError, error_body_for
from folio.server.openai.chat.prompt import PreparedChat, prepare_chat
from folio.server.openai.chat.protocol import ChatCompletionRequest, chat_request_from
from folio.tool_calls.types import ToolCall


def _chat_request(ctx: ServerContext, body: CountTokensRequest) -> ChatCompletionRequest:
    fields = body.chat_fields()
    thinking = body.thinking is not None and body.thinking.type == "enabled"
    if thinking and not reasoning_enabled(ctx.chat.reasoning_parser, ctx.tokenizer.chat_template):
        raise APIError(400, f"'{ctx.model_name}' does not think: thinking cannot be enabled", param="thinking")
    return chat_request_from(fields)


async def count_tokens(ctx: ServerContext, body: CountTokensRequest) -> dict[str, int]:
    request = _chat_request(ctx, body)
    with ctx.admission.reserve(1):  # it tokenizes as a generation does, so it takes a slot as one
        prepared = await run_in_threadpool(prepare_chat, ctx, request)
    return {"input_tokens": len(prepared.prompt.token_ids)}


def stop_reason(finish_reason: str | None, stop_sequence: str | None, called: bool) -> str:
    if called:
        return "tool_use"
    if finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


def _tool_block(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": json.loads(call.arguments)}


async def create_message(ctx: ServerContext, body: MessagesRequest):
    prepared = await run_in_threadpool(prepare_chat, ctx, _chat_request(ctx, body))
    show_thinking = body.thinking is None or body.thinking.display != "omitted"
    head = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": ctx.model_name}
    with ctx.open_call(1, "n") as call:
        call.generation.add(prepared.prompt.token_ids, prepared.params)
        if body.stream:
            events = _stream(head, prepared, call.generation, show_thinking)
            return call.stream(events, _error_event)
        [result] = await call.collect(1)
    answer = prepared.prompt.reader.read(result.text, result.finish_reason)
    content: list[dict[str, Any]] = []
    if answer.reasoning:
        thought = answer.reasoning if show_thinking else ""
        content.append({"type": "thinking", "thinking": thought, "signature": ""})
    if answer.content:
        content.append({"type": "text", "text": answer.content})
    content.extend(_tool_block(call) for call in answer.tool_calls)
    usage = {"input_tokens": len(prepared.prompt.token_ids), "output_tokens": len(result.token_ids)}
    reason = stop_reason(result.finish_reason, result.stop_reason, bool(answer.tool_calls))
    return {**head, "content": content, "stop_reason": reason, "stop_sequence": result.stop_reason, "usage": usage}


def _event(payload: dict[str, Any]) -> str:
    return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


class _Blocks:
    """Anthropic streams an answer as numbered content blocks: each opened, filled by deltas, closed."""

    def __init__(self) -> None:
        self.index = -1
        self.open_kind: str | None = None

    def switch_to(self, kind: str, block: dict[str, Any]) -> list[str]:
        events = self.close()
        self.index += 1
        self.open_kind = kind
        return [*events, _event({"type": "content_block_start", "index": self.index, "content_block": block})]

    def delta(self, kind: str, delta: dict[str, Any], block: dict[str, Any]) -> list[str]:
        events = self.switch_to(kind, block) if self.open_kind != kind else []
        return [*events, _event({"type": "content_block_delta", "index": self.index, "delta": delta})]

    def close(self) -> list[str]:
        if self.open_kind is None:
            return []
        self.open_kind = None
        return [_event({"type": "content_block_stop", "index": self.index})]


def _piece_events(piece: AnswerPiece, blocks: _Blocks, show_thinking: bool) -> list[str]:
    events: list[str] = []
    thinking_block = {"type": "thinking", "thinking": "", "signature": ""}
    if piece.reasoning and show_thinking:
        events += blocks.delta("thinking", {"type": "thinking_delta", "thinking": piece.reasoning}, thinking_block)
    elif piece.reasoning and blocks.open_kind != "thinking":  # display "omitted": the block, empty
        events += blocks.switch_to("thinking", thinking_block)
    if piece.content:
        events += blocks.delta("text", {"type": "text_delta", "text": piece.content}, {"type": "text", "text": ""})
    for call in piece.tool_calls:
        events += blocks.switch_to("tool_use", {**_tool_block(call), "input": {}})
        events.append(_event({"type": "content_block_delta", "index": blocks.index,
                              "delta": {"type": "input_json_delta", "partial_json": call.arguments}}))  # fmt: skip
        events += blocks.close()
    return events


async def _stream(
    head: dict[str, Any], prepared: PreparedChat, generation: GenerationStream, show_thinking: bool
) -> AsyncIterator[str]:
    prompt_tokens = len(prepared.prompt.token_ids)
    message = {**head, "content": [], "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}  # fmt: skip
    yield _event({"type": "message_start", "message": message})
    answer, blocks, output_tokens = prepared.prompt.reader.stream(), _Blocks(), 0
    async for _, update in generation:
        output_tokens += len(update.new_token_ids)
        for event in _piece_events(answer.feed(update.text), blocks, show_thinking) if update.text else []:
            yield event
        if update.finished:
            for event in [*_piece_events(answer.finish(), blocks, show_thinking), *blocks.close()]:
                yield event
            reason = stop_reason(update.finish_reason, update.stop_reason, answer.num_calls > 0)
            delta = {"stop_reason": reason, "stop_sequence": update.stop_reason}
            yield _event({"type": "message_delta", "delta": delta, "usage": {"output_tokens": output_tokens}})
    yield _event({"type": "message_stop"})


def _error_event(error: APIError) -> str:
    """A failure after the 200 becomes Anthropic's `error` event, which its SDK raises."""
    return _event(error_body_for("/v1/messages", error.status, error.message))
