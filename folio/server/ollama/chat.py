"""Ollama's /api/chat and /api/generate on folio's chat pipeline: an Ollama body becomes the same
checked request the OpenAI routes build (chat_prompt.prepare_chat), and the answer is read by the same
AnswerReader, then written in Ollama's shapes: NDJSON lines while streaming (the default), one object
otherwise, ending with Ollama's counts and durations (nanoseconds, measured here)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from starlette.concurrency import run_in_threadpool

from folio.reasoning import reasoning_enabled
from folio.server.chat_answer import Answer, AnswerPiece, AnswerReader
from folio.server.context import ServerContext
from folio.server.engine_client.updates import ChoiceResult
from folio.server.errors import APIError, engine_errors
from folio.server.model_card import iso_time
from folio.server.ollama.protocol import (
    GeneratingBody,
    OllamaChatRequest,
    OllamaGenerateRequest,
    OllamaMessage,
    OllamaOptions,
)
from folio.server.openai.chat.prompt import ChatPrompt, PreparedChat, finish_preparing, prepare_chat
from folio.server.openai.chat.protocol import ChatCompletionRequest, chat_request_from
from folio.tool_calls.types import ToolCall

NDJSON = "application/x-ndjson"


def _common_fields(ctx: ServerContext, body: GeneratingBody) -> dict[str, Any]:
    if ctx.preset is not None and ctx.preset.parameters:  # a created model's PARAMETERs, under the request's
        body.options = OllamaOptions(**{**ctx.preset.parameters, **body.options.model_dump(exclude_none=True)})
    body.options.check_extras()
    if body.images:
        raise APIError(400, "images are not supported: this server runs text models", param="images")
    fields = {"model": ctx.model_name, "response_format": body.response_format(), **body.options.sampling_fields()}
    if body.logprobs:
        fields.update(logprobs=True, top_logprobs=body.top_logprobs)
    thinking = reasoning_enabled(ctx.chat.reasoning_parser, ctx.tokenizer.chat_template)
    if body.think not in (None, False) and not thinking:
        raise APIError(400, f"'{ctx.model_name}' does not support thinking", param="think")
    if body.think is not None and thinking:
        fields["chat_template_kwargs"] = {"enable_thinking": body.think is not False}
    return fields


def _messages(messages: list[OllamaMessage]) -> list[dict[str, Any]]:
    """Ollama's messages as OpenAI's: calls get ids, and each tool result answers the earliest call of
    its tool still unanswered (Ollama matches them by name and order)."""
    converted: list[dict[str, Any]] = []
    unanswered: list[tuple[str, str]] = []  # (id, tool name)
    for number, message in enumerate(messages):
        if message.images:
            raise APIError(400, "images are not supported: this server runs text models", param="messages")
        entry: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.tool_calls:
            calls = []
            for index, call in enumerate(message.tool_calls):
                call_id = f"call_{number}_{index}"
                unanswered.append((call_id, call.function.name))
                arguments = json.dumps(call.function.arguments, ensure_ascii=False)
                calls.append({"id": call_id, "type": "function",
                              "function": {"name": call.function.name, "arguments": arguments}})  # fmt: skip
            entry["tool_calls"] = calls
        if message.role == "tool":
            match = next((c for c in unanswered if message.tool_name in (None, c[1])), None)
            if match is not None:
                unanswered.remove(match)
            entry["tool_call_id"] = match[0] if match else f"call_{number}"
            if message.tool_name:
                entry["name"] = message.tool_name
        converted.append(entry)
    return converted


def _with_preset(ctx: ServerContext, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A created model's SYSTEM (unless the request has its own) and MESSAGE lines before the request's."""
    preset = ctx.preset
    if preset is None:
        return messages
    first = messages[:1] if messages and messages[0]["role"] == "system" else []
    if not first and preset.system is not None:
        first = [{"role": "system", "content": preset.system}]
    rest = messages[1:] if messages and messages[0]["role"] == "system" else messages
    return [*first, *(dict(m) for m in preset.messages), *rest]


def _ollama_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    return [
        {"function": {"index": i, "name": c.name, "arguments": json.loads(c.arguments)}} for i, c in enumerate(calls)
    ]


@dataclass
class _Clock:
    """Ollama's durations: prompt evaluation runs until the first new token, evaluation after it."""

    start: int = field(default_factory=time.perf_counter_ns)
    first_token: int | None = None

    def saw_token(self) -> None:
        if self.first_token is None:
            self.first_token = time.perf_counter_ns()

    def stats(self, prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
        end = time.perf_counter_ns()
        first = self.first_token or end
        return {"total_duration": end - self.start, "load_duration": 0, "prompt_eval_count": prompt_tokens,
                "prompt_eval_duration": first - self.start, "eval_count": completion_tokens,
                "eval_duration": end - first}  # fmt: skip


async def ollama_chat(ctx: ServerContext, body: OllamaChatRequest):
    clock = _Clock()
    fields = _common_fields(ctx, body)
    if not body.messages:  # Ollama's way of loading a model
        return _loaded(ctx, chat=True)
    messages = _with_preset(ctx, _messages(body.messages))
    openai_body = chat_request_from({**fields, "messages": messages, "tools": body.tools})
    prepared = await run_in_threadpool(prepare_chat, ctx, openai_body, body.options.num_ctx)
    return await _answer(ctx, prepared, body.stream, clock, chat=True)


async def ollama_generate(ctx: ServerContext, body: OllamaGenerateRequest):
    clock = _Clock()
    fields = _common_fields(ctx, body)
    for name in ("suffix", "template"):
        if getattr(body, name):
            raise APIError(400, f"'{name}' is not supported by this server", param=name)
    if not body.prompt and not body.context:
        return _loaded(ctx, chat=False)
    messages = [{"role": "system", "content": body.system}] if body.system else []
    messages.append({"role": "user", "content": body.prompt})
    openai_body = chat_request_from({**fields, "messages": _with_preset(ctx, messages)})
    prepared = await run_in_threadpool(_prepare_generate, ctx, body, openai_body)
    return await _answer(ctx, prepared, body.stream, clock, chat=False)


def _prepare_generate(
    ctx: ServerContext, body: OllamaGenerateRequest, openai_body: ChatCompletionRequest
) -> PreparedChat:
    context = list(body.context or [])
    if body.raw or not ctx.tokenizer.chat_template:  # a base model's prompt is its own text
        ids = ctx.tokenizer.encode(body.prompt, add_special_tokens=not context)
        prompt = ChatPrompt(context + ids, AnswerReader(), None)
        return finish_preparing(ctx, openai_body, prompt, body.options.num_ctx)
    return prepare_chat(ctx, openai_body, body.options.num_ctx, prefix_ids=context)


def _envelope(ctx: ServerContext, part: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """A reply (or one line of it): the model and the time, then the answer's `part` and `fields`."""
    return {"model": ctx.model_name, "created_at": iso_time(time.time()), **part, **fields}


def _loaded(ctx: ServerContext, chat: bool) -> dict[str, Any]:
    part = {"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}
    return _envelope(ctx, part, done=True, done_reason="load")


def _last(
    ctx: ServerContext, part: dict[str, Any], finish_reason: str | None, chat: bool, prompt_ids: list[int],
    output_ids: list[int], clock: _Clock,
) -> dict[str, Any]:  # fmt: skip
    """The reply's last object: why it ended (Ollama says "stop" after tool calls too) and its counts."""
    reason = "length" if finish_reason == "length" else "stop"
    context = {} if chat else {"context": prompt_ids + output_ids}
    counts = clock.stats(len(prompt_ids), len(output_ids))
    return _envelope(ctx, part, done=True, done_reason=reason, **context, **counts)


def _part(piece: AnswerPiece | Answer, chat: bool) -> dict[str, Any]:
    """An answer (or a piece of one) in Ollama's shape, without the envelope."""
    content, thinking = piece.content or "", piece.reasoning or ""
    if not chat:
        return {"response": content, **({"thinking": thinking} if thinking else {})}
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if thinking:
        message["thinking"] = thinking
    if piece.tool_calls:
        message["tool_calls"] = _ollama_calls(piece.tool_calls)
    return {"message": message}


async def _answer(ctx: ServerContext, prepared: PreparedChat, stream: bool, clock: _Clock, chat: bool):
    prompt_ids = prepared.prompt.token_ids
    with ctx.open_call(1, "n") as call:
        call.generation.add(prompt_ids, prepared.params)
        if stream:
            return call.stream(_stream(ctx, prepared, call.generation, clock, chat), _error_line, NDJSON)
        result = ChoiceResult()
        with engine_errors():
            async for _, update in call.generation:
                if update.new_token_ids:
                    clock.saw_token()
                result.add(update)
    answer = prepared.prompt.reader.read(result.text, result.finish_reason)
    return _last(ctx, _part(answer, chat), result.finish_reason, chat, prompt_ids, result.token_ids, clock)


def _line(payload: dict[str, Any]) -> str:
    return json.dumps(payload, ensure_ascii=False) + "\n"


async def _stream(ctx: ServerContext, prepared: PreparedChat, generation, clock: _Clock, chat: bool):
    answer = prepared.prompt.reader.stream()
    output_ids: list[int] = []
    async for _, update in generation:
        if update.new_token_ids:
            clock.saw_token()
        output_ids += update.new_token_ids
        pieces = [answer.feed(update.text)] if update.text else []
        if update.finished:
            pieces.append(answer.finish())
        for piece in pieces:
            if piece.content or piece.reasoning or piece.tool_calls:
                yield _line(_envelope(ctx, _part(piece, chat), done=False))
        if update.finished:
            part = _part(AnswerPiece(), chat)
            yield _line(_last(ctx, part, update.finish_reason, chat, prepared.prompt.token_ids, output_ids, clock))


def _error_line(error: APIError) -> str:
    """A failure after the 200 becomes Ollama's error line, which its clients raise."""
    return _line({"error": error.message})
