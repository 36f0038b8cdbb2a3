"""POST /v1/chat/completions: messages rendered with the model's chat template, answered as the
assistant; thinking, tool calls and prose split as chat_answer.py reads them."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.concurrency import run_in_threadpool

from folio.server.chat_answer import Answer, AnswerPiece, AnswerStream
from folio.server.context import ServerContext
from folio.server.engine_client.protocol import GenerationStream
from folio.server.openai.chat.prompt import ChatPrompt, prepare_chat
from folio.server.openai.chat.protocol import ChatCompletionRequest
from folio.server.openai.logprobs_format import TokenText, chat_logprobs
from folio.server.sse import DONE, event, usage


async def create_chat_completion(ctx: ServerContext, body: ChatCompletionRequest):
    # Everything is checked before the call takes anything; templating and tokenizing off the event loop.
    prepared = await run_in_threadpool(prepare_chat, ctx, body)
    prompt, prompt_ids, choice_params = prepared.prompt, prepared.prompt.token_ids, prepared.params
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": ctx.model_name}
    with ctx.open_call(body.num_sequences, "beam_width" if body.use_beam_search else "n") as call:
        call.generation.add(prompt_ids, choice_params, body.cache_salt, body.priority)
        if body.stream:
            events = _stream(ctx, body, prompt, head, call.generation)
            return call.stream(events)
        results = await call.collect(body.n)
    token_text = TokenText(ctx.tokenizer)
    choices = []
    for index, result in enumerate(results):
        answer = prompt.reader.read(result.text, result.finish_reason)
        logprobs_field = chat_logprobs(token_text, result.logprobs) if body.logprobs else None
        choices.append({"index": index, "message": _message(answer, prompt.reader.reasoning),
                        "logprobs": logprobs_field, "finish_reason": answer.finish_reason})  # fmt: skip
    completion_tokens = sum(len(r.token_ids) for r in results)
    cached = max(r.num_cached_tokens for r in results)  # the choices share one prompt
    return {**head, "object": "chat.completion", "choices": choices,
            "usage": usage(len(prompt_ids), completion_tokens, cached)}  # fmt: skip


def _message(answer: Answer, reasoning: bool) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": answer.content}
    if reasoning:
        message["reasoning_content"] = message["reasoning"] = answer.reasoning
    if answer.tool_calls:
        message["tool_calls"] = [call.as_openai() for call in answer.tool_calls]
    return message


def _deltas(piece: AnswerPiece, stream: AnswerStream) -> list[dict[str, Any]]:
    """A piece of the answer as OpenAI's deltas; each call as OpenAI streams one: its id and name
    first, then its arguments."""
    deltas: list[dict[str, Any]] = []
    if piece.reasoning:
        deltas.append({"reasoning_content": piece.reasoning, "reasoning": piece.reasoning})
    if piece.content:
        deltas.append({"content": piece.content})
    first = stream.num_calls - len(piece.tool_calls)
    for index, call in enumerate(piece.tool_calls, start=first):
        head = call.as_openai(index)
        deltas.append({"tool_calls": [{**head, "function": {"name": call.name, "arguments": ""}}]})
        deltas.append({"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]})
    return deltas


async def _stream(
    ctx: ServerContext, body: ChatCompletionRequest, prompt: ChatPrompt, head: dict, generation: GenerationStream
) -> AsyncIterator[str]:
    reader, head = prompt.reader, {**head, "object": "chat.completion.chunk"}
    extra = {"usage": None} if body.include_usage else {}
    token_text = TokenText(ctx.tokenizer)
    answers = [reader.stream() for _ in range(body.n)]
    completion_tokens = cached = 0

    def chunk(index: int, delta: dict, logprobs: dict | None = None, finish_reason: str | None = None) -> str:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return event({**head, "choices": [choice], **extra})

    for index in range(body.n):
        yield chunk(index, {"role": "assistant", "content": ""})
    async for index, update in generation:
        completion_tokens += len(update.new_token_ids)
        cached = max(cached, update.num_cached_tokens)
        logprobs = chat_logprobs(token_text, update.new_logprobs) if body.logprobs else None
        deltas = _deltas(answers[index].feed(update.text), answers[index]) if update.text else []
        if update.finished:
            deltas += _deltas(answers[index].finish(), answers[index])
        if logprobs and logprobs["content"] and not deltas:
            deltas = [{}]  # the tokens' logprobs go out even while their text is held back
        for number, delta in enumerate(deltas):
            yield chunk(index, delta, logprobs if number == 0 else None)
        if update.finished:
            finish_reason = reader.finish_reason(update.finish_reason, answers[index].num_calls > 0)
            yield chunk(index, {}, finish_reason=finish_reason)
    if body.include_usage:
        yield event({**head, "choices": [], "usage": usage(len(prompt.token_ids), completion_tokens, cached)})
    yield DONE
