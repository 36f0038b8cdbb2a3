"""POST /v1/chat/completions: messages rendered with the model's chat template, answered as the assistant."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from folio.engine.async_engine import EngineDeadError, RequestFailedError
from folio.loaders.tokenizer import ChatTemplateError
from folio.server.choices import collect
from folio.server.context import ServerContext
from folio.server.engine_client import GenerationStream
from folio.server.errors import APIError, error_for
from folio.server.lifetime import ClosingStreamingResponse
from folio.server.logprobs_format import TokenText, chat_logprobs
from folio.server.protocol import ChatCompletionRequest, ChatMessage
from folio.server.sse import DONE, event, guarded, usage


def encode_messages(ctx: ServerContext, messages: list[ChatMessage], add_generation_prompt: bool = True) -> list[int]:
    try:
        return ctx.tokenizer.encode_chat([m.as_template_message() for m in messages], add_generation_prompt)
    except ChatTemplateError as exc:
        raise APIError(400, str(exc), param="messages") from exc


async def create_chat_completion(ctx: ServerContext, body: ChatCompletionRequest):
    # Everything is checked before the call takes admission slots or engine requests.
    ctx.check_model(body.model)
    body.reject_unsupported()
    prompt_ids = encode_messages(ctx, body.messages, body.add_generation_prompt)
    ctx.check_prompt(prompt_ids)
    # Without a limit the answer may run to the end of the context, as with OpenAI.
    max_tokens = min(body.completion_limit or ctx.max_model_len, ctx.default_max_tokens(len(prompt_ids)))
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    ctx.limits.check_logprobs(body.n, logprobs, max_tokens, "top_logprobs")
    choice_params = body.choice_params(ctx.limits, ctx.vocab_size, max_tokens, body.n, logprobs)
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": ctx.model_name}
    with ctx.open_call(body.num_sequences, "beam_width" if body.use_beam_search else "n") as call:
        call.generation.add(prompt_ids, choice_params, body.cache_salt, body.priority)
        if body.stream:
            events = _stream(ctx, body, head, call.generation, len(prompt_ids))
            return ClosingStreamingResponse(guarded(events), on_close=call.hand_off().close)
        try:
            results = await collect(call.generation, body.n)
        except (EngineDeadError, RequestFailedError, ValueError) as exc:
            raise error_for(exc) from exc
    token_text = TokenText(ctx.tokenizer)
    choices = [
        {
            "index": index,
            "message": {"role": "assistant", "content": result.text},
            "logprobs": chat_logprobs(token_text, result.logprobs) if body.logprobs else None,
            "finish_reason": result.finish_reason,
        }
        for index, result in enumerate(results)
    ]
    completion_tokens = sum(len(r.token_ids) for r in results)
    return {**head, "object": "chat.completion", "choices": choices,
            "usage": usage(len(prompt_ids), completion_tokens)}  # fmt: skip


async def _stream(
    ctx: ServerContext, body: ChatCompletionRequest, head: dict, generation: GenerationStream, prompt_tokens: int
) -> AsyncIterator[str]:
    head = {**head, "object": "chat.completion.chunk"}
    extra = {"usage": None} if body.include_usage else {}
    token_text = TokenText(ctx.tokenizer)
    completion_tokens = 0

    def chunk(index: int, delta: dict, logprobs: dict | None = None, finish_reason: str | None = None) -> str:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return event({**head, "choices": [choice], **extra})

    for index in range(body.n):
        yield chunk(index, {"role": "assistant", "content": ""})
    async for index, update in generation:
        completion_tokens += len(update.new_token_ids)
        logprobs = chat_logprobs(token_text, update.new_logprobs) if body.logprobs else None
        if update.text or (logprobs and logprobs["content"]):
            yield chunk(index, {"content": update.text}, logprobs)
        if update.finished:
            yield chunk(index, {}, finish_reason=update.finish_reason)
    if body.include_usage:
        yield event({**head, "choices": [], "usage": usage(prompt_tokens, completion_tokens)})
    yield DONE
