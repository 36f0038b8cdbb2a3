"""OpenAI's Responses API on folio's chat pipeline, stateless: POST /v1/responses, whole or streamed as
the API's typed events. A Responses body becomes the chat request (protocol.py); its answer is
read by the chat AnswerReader and written as output items: reasoning, a message, function calls."""

from __future__ import annotations

from typing import Any

from starlette.concurrency import run_in_threadpool

from folio.server.context import ServerContext
from folio.server.engine_client.updates import ChoiceResult
from folio.server.openai.chat.prompt import PreparedChat, prepare_chat
from folio.server.openai.chat.protocol import chat_request_from
from folio.server.openai.logprobs_format import TokenText, chat_logprobs
from folio.server.openai.responses.items import ResponseShell, output_items, usage
from folio.server.openai.responses.protocol import ResponsesRequest
from folio.server.openai.responses.stream import ResponseEvents


async def create_response(ctx: ServerContext, body: ResponsesRequest):
    chat = chat_request_from(body.chat_fields())
    prepared = await run_in_threadpool(prepare_chat, ctx, chat)
    shell = ResponseShell(ctx, body, chat)
    with ctx.open_call(1, "n") as call:
        call.generation.add(prepared.prompt.token_ids, prepared.params)
        if body.stream:
            events = ResponseEvents(shell, prepared, TokenText(ctx.tokenizer) if body.wants_logprobs else None)
            return call.stream(events.run(call.generation), ResponseEvents.error_event)
        [result] = await call.collect(1)
    return whole_response(ctx, body, shell, prepared, result)


def whole_response(
    ctx: ServerContext, body: ResponsesRequest, shell: ResponseShell, prepared: PreparedChat, result: ChoiceResult
) -> dict[str, Any]:
    answer = prepared.prompt.reader.read(result.text, result.finish_reason)
    # Chat's logprobs entries are the Responses shape too (token, logprob, bytes, top_logprobs).
    logprobs = chat_logprobs(TokenText(ctx.tokenizer), result.logprobs)["content"] if body.wants_logprobs else []
    status = "incomplete" if result.finish_reason == "length" else "completed"
    return shell.whole(output_items(answer, logprobs), status, usage(len(prepared.prompt.token_ids),
                                                                     len(result.token_ids)))  # fmt: skip
