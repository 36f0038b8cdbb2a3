"""The FastAPI application: folio's routes on top of the async engine.

OpenAI: /v1/completions, /v1/chat/completions (tools, reasoning), /v1/responses, /v1/embeddings, /v1/models.
Anthropic: /v1/messages, /v1/messages/count_tokens. Ollama: /api/chat, /api/generate, /api/embed,
/api/tags, ... (ollama/routes.py).
folio and vLLM: /tokenize, /detokenize, /tokenizer_info, /health, /metrics. The web playground at / and the
dashboard at /dashboard (ui/routes.py).
Every failure a client can cause is answered in the API's own error format and the server keeps serving.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from folio.paths import folio_home
from folio.server.answer_body import json_answer
from folio.server.anthropic.protocol import CountTokensRequest, MessagesRequest
from folio.server.anthropic.routes import count_tokens, create_message
from folio.server.auth import APIKeyDigest, APIKeyMiddleware
from folio.server.body_limit import BodySizeLimit, too_large_message
from folio.server.body_route import OffLoopBodyRoute, warm_json_scanner
from folio.server.context import ServerContext
from folio.server.errors import INTERNAL_ERROR, APIError, error_response
from folio.server.lifetime import cancel_on_disconnect
from folio.server.limits import RequestLimits
from folio.server.model_routes import model_router
from folio.server.ollama.create import BlobStore, ollama_create_router
from folio.server.ollama.routes import ollama_router
from folio.server.openai.chat.prompt import encode_messages
from folio.server.openai.chat.protocol import ChatCompletionRequest
from folio.server.openai.chat.routes import create_chat_completion
from folio.server.openai.completions import create_completion
from folio.server.openai.embeddings import EmbeddingRequest, create_embedding
from folio.server.openai.protocol import CompletionRequest, DetokenizeRequest, TokenizeRequest
from folio.server.openai.responses.protocol import ResponsesRequest
from folio.server.openai.responses.routes import create_response
from folio.server.request_body import BODY_ERROR_TYPES
from folio.server.served_models import ServedModels
from folio.server.ui.routes import ui_router

logger = logging.getLogger("folio")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    first = exc.errors()[0]
    location = [str(p) for p in first.get("loc", ())[1:]]
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    if first.get("type") == "extra_forbidden":
        return f"unknown parameter '{location[-1]}'", location[-1]
    if first.get("type") in BODY_ERROR_TYPES:
        return str(first.get("msg")), first.get("ctx", {}).get("param")
    param = ".".join(location) or None
    message = str(first.get("msg"))
    return (f"{param}: {message}" if param else message), param


def create_app(
    models: ServedModels, limits: RequestLimits, metrics_registry: CollectorRegistry | None = None,
    api_key: str | APIKeyDigest | None = None, ui: bool = True,
) -> FastAPI:  # fmt: skip
    """folio's app; `ui`: with the playground at / and the dashboard at /dashboard."""
    app = FastAPI(title="folio", docs_url=None, redoc_url=None)
    app.router.route_class = OffLoopBodyRoute  # the routes below, and the Ollama router's
    warm_json_scanner()
    if api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=api_key, open_ui=ui)
    app.add_middleware(BodySizeLimit, max_body_bytes=limits.max_body_bytes)  # outermost: added last

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(APIError(400, message, param=param), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Routing and body errors (404, 405, 413, ...) in the same error format as everything else.
        message = str(exc.detail)
        if exc.status_code == 413:
            message = too_large_message(limits.max_body_bytes)
        return error_response(APIError(exc.status_code, message, headers=exc.headers), request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.error("request failed", exc_info=exc)
        return error_response(APIError(500, INTERNAL_ERROR), request.url.path)

    async def answer(name: str | None, handler: Callable[[ServerContext, Any], Awaitable[Any]], body: Any) -> Any:
        """The handler's answer on the named model (loaded first if need be, and held meanwhile)."""
        async with models.use(name) as ctx:
            return await handler(ctx, body)

    @app.get("/health")
    async def health() -> JSONResponse:
        if not models.is_alive:
            return error_response(APIError(503, "the engine has stopped", code="engine_dead"))
        return JSONResponse({"status": "ok"})

    app.include_router(model_router(models))

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        return await cancel_on_disconnect(request, answer(body.model, create_completion, body))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest):
        return await cancel_on_disconnect(request, answer(body.model, create_chat_completion, body))

    @app.post("/v1/embeddings")
    async def embeddings(request: Request, body: EmbeddingRequest):
        return await cancel_on_disconnect(request, answer(body.model, create_embedding, body))

    app.include_router(ollama_router(models))
    app.include_router(ollama_create_router(models, BlobStore(folio_home() / "blobs")))

    @app.post("/v1/responses")
    async def responses(request: Request, body: ResponsesRequest):
        return await cancel_on_disconnect(request, answer(body.model, create_response, body))

    @app.post("/v1/messages")
    async def messages(request: Request, body: MessagesRequest):
        return await cancel_on_disconnect(request, answer(body.model, create_message, body))

    @app.post("/v1/messages/count_tokens")
    async def messages_count_tokens(body: CountTokensRequest) -> dict:
        return await answer(body.model, count_tokens, body)

    def tokenize_body(ctx: ServerContext, body: TokenizeRequest) -> list[int]:
        if body.messages is not None:
            return encode_messages(ctx, body.messages, body.add_generation_prompt)
        return ctx.tokenizer.encode(body.prompt or "", add_special_tokens=body.add_special_tokens)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        async with models.use(body.model) as ctx:
            with ctx.admission.reserve(1):  # tokenizing costs what a generation's prompt does: it waits its turn
                tokens = await run_in_threadpool(tokenize_body, ctx, body)
            return await json_answer({"count": len(tokens), "max_model_len": ctx.max_model_len, "tokens": tokens})

    @app.get("/tokenizer_info")
    async def tokenizer_info(model: str | None = None) -> dict:
        # vLLM's route: what a client needs to tokenize as the server does (lm-eval's "remote" tokenizer).
        async with models.use(model) as ctx:
            tokenizer = ctx.tokenizer
            return {"tokenizer_class": "folio", "bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token,
                    "pad_token": None, "chat_template": tokenizer.chat_template,
                    "model_max_length": ctx.max_model_len, "vocab_size": ctx.vocab_size}  # fmt: skip

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        if len(body.tokens) > limits.max_prompt_tokens:
            raise APIError(400, f"at most {limits.max_prompt_tokens} tokens can be detokenized at once "
                           "(--max-request-tokens)", param="tokens")  # fmt: skip
        async with models.use(body.model) as ctx:
            if any(not 0 <= t < ctx.vocab_size for t in body.tokens):
                raise APIError(400, f"token ids must be in [0, {ctx.vocab_size})", param="tokens")
            with ctx.admission.reserve(1):
                return {"prompt": await run_in_threadpool(ctx.tokenizer.decode, body.tokens)}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        if metrics_registry is None:
            raise APIError(404, "metrics are disabled")
        # Off the event loop: an engine in its own process is asked for its metrics, which takes a step.
        body = await run_in_threadpool(generate_latest, metrics_registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    if ui:
        app.include_router(ui_router())
    return app
