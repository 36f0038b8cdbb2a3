"""The FastAPI application: OpenAI-compatible completions on top of the async engine.

This first step serves /health, /v1/models and /v1/completions (streaming and not); chat, tokenize,
metrics, limits and auth follow in the server issue.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from folio.engine.async_engine import AsyncEngine
from folio.loaders.tokenizer import Tokenizer
from folio.sampling_params import SamplingParams
from folio.server.protocol import CompletionRequest


def error_response(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
    return JSONResponse(
        status_code=status, content={"error": {"message": message, "type": kind, "param": param, "code": None}}
    )


def create_app(engine: AsyncEngine, tokenizer: Tokenizer, model_name: str) -> FastAPI:
    app = FastAPI(title="folio")

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return error_response(400, f"{param}: {first.get('msg')}" if param else str(first.get("msg")), param=param)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "folio"}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        if body.model != model_name:
            return error_response(404, f"model {body.model!r} is not served here; try {model_name!r}", param="model")
        if isinstance(body.prompt, list) and body.prompt and isinstance(body.prompt[0], str):
            return error_response(400, "this server takes one prompt per request for now", param="prompt")
        prompt_ids = tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
        params = SamplingParams(
            max_tokens=body.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            min_p=body.min_p,
            seed=body.seed,
            ignore_eos=body.ignore_eos,
        )
        completion_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        updates = engine.generate(prompt_ids, params)
        try:
            first = await anext(updates)
        except ValueError as exc:
            return error_response(400, str(exc), param="prompt")
        if body.stream:
            return StreamingResponse(
                _stream(first, updates, tokenizer, completion_id, created, model_name), media_type="text/event-stream"
            )
        token_ids = list(first.new_token_ids)
        last = first
        async for update in updates:
            token_ids.extend(update.new_token_ids)
            last = update
        return {
            "id": completion_id,
            "object": "text_completion",
            "created": created,
            "model": model_name,
            "choices": [
                {"index": 0, "text": tokenizer.decode(token_ids), "logprobs": None, "finish_reason": last.finish_reason}
            ],
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": len(token_ids),
                "total_tokens": len(prompt_ids) + len(token_ids),
            },
        }

    return app


async def _stream(
    first, updates: AsyncIterator, tokenizer: Tokenizer, completion_id: str, created: int, model_name: str
) -> AsyncIterator[str]:
    decoder = tokenizer.decode_stream()

    def chunk(text: str, finish_reason: str | None) -> str:
        payload = {
            "id": completion_id,
            "object": "text_completion",
            "created": created,
            "model": model_name,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
        }
        return f"data: {json.dumps(payload)}\n\n"

    update = first
    while True:
        text = "".join(decoder.step(t) for t in update.new_token_ids)
        yield chunk(text, update.finish_reason if update.finished else None)
        if update.finished:
            break
        update = await anext(updates)
    yield "data: [DONE]\n\n"
