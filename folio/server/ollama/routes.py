"""Ollama's native API on the same engine: apps written for Ollama work by changing only the port.

/api/chat and /api/generate (ollama_chat.py), /api/embed and /api/embeddings (the vectors of
/v1/embeddings), and the model routes:
/api/tags and /api/ps list the one served model, /api/show describes it, /api/pull of it succeeds at
once (it is already here; any other name is a 404), /api/version gives folio's version. Errors come
as Ollama's `{"error": "..."}` (errors.py picks the format by path)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from folio import __version__
from folio.reasoning import reasoning_enabled
from folio.server.body_route import OffLoopBodyRoute
from folio.server.context import ServerContext
from folio.server.errors import APIError
from folio.server.lifetime import cancel_on_disconnect
from folio.server.model_card import ModelCard, iso_time
from folio.server.ollama.chat import NDJSON, check_ollama_model, ollama_chat, ollama_generate
from folio.server.ollama.protocol import (
    OllamaChatRequest,
    OllamaEmbeddingsRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
    OllamaModelRequest,
)
from folio.server.openai.embeddings import embed_inputs

KEEP_LOADED = 10 * 365 * 24 * 3600  # /api/ps's expires_at: the model stays loaded while the server runs


def _card(ctx: ServerContext) -> ModelCard:
    if ctx.model_card is None:
        raise APIError(404, "this server does not describe its model")
    return ctx.model_card


class ModelDigest:
    """The served model file's sha256, hashed once on a worker thread; calls that come while it is being
    hashed wait for that one hashing. A file that cannot be read (deleted while serving) is a 503, and the
    next call tries again."""

    def __init__(self, ctx: ServerContext) -> None:
        self._ctx = ctx
        self._hashing: asyncio.Future[str] | None = None

    async def get(self) -> str:
        if self._hashing is None:
            self._hashing = asyncio.ensure_future(run_in_threadpool(_card(self._ctx).compute_digest))
        try:
            return await asyncio.shield(self._hashing)  # a caller that leaves does not cancel the others' hashing
        except OSError as exc:
            self._hashing = None
            raise APIError(503, f"the model file can no longer be read ({exc.strerror or type(exc).__name__}); "
                           "the model stays loaded, but its digest is unknown") from None  # fmt: skip


async def _listing(ctx: ServerContext, digest: ModelDigest) -> dict[str, Any]:
    card = _card(ctx)
    return {"name": card.name, "model": card.name, "modified_at": card.modified_at, "size": card.size_bytes,
            "digest": await digest.get(), "details": card.details()}  # fmt: skip


def _capabilities(ctx: ServerContext) -> list[str]:
    capabilities = ["completion", "tools", "embedding"]
    if reasoning_enabled(ctx.chat.reasoning_parser, ctx.tokenizer.chat_template):
        capabilities.append("thinking")
    return capabilities


async def _embed(ctx: ServerContext, body: OllamaEmbedRequest) -> dict:
    start = time.perf_counter_ns()
    check_ollama_model(ctx, body.model)
    body.options.check_extras()
    texts = [body.input] if isinstance(body.input, str) else body.input
    if not texts:
        raise APIError(400, "input must not be empty", param="input")
    inputs = await run_in_threadpool(_tokenize_inputs, ctx, texts, body.truncate)
    vectors = await embed_inputs(ctx, inputs, body.dimensions)
    return {"model": ctx.model_name, "embeddings": [v.float().tolist() for v in vectors],
            "total_duration": time.perf_counter_ns() - start, "load_duration": 0,
            "prompt_eval_count": sum(len(ids) for ids in inputs)}  # fmt: skip


def _tokenize_inputs(ctx: ServerContext, texts: list[str], truncate: bool) -> list[list[int]]:
    ctx.limits.check_inputs(len(texts), "input")
    inputs = [ctx.tokenizer.encode(text) for text in texts]
    if truncate:  # Ollama cuts an input to the context rather than refusing it
        inputs = [ids[: ctx.max_model_len] for ids in inputs]
    ctx.limits.check_prompt_tokens(sum(len(ids) for ids in inputs), "input")
    return inputs


async def _embeddings(ctx: ServerContext, body: OllamaEmbeddingsRequest) -> dict:
    check_ollama_model(ctx, body.model)
    body.options.check_extras()
    [vector] = await embed_inputs(ctx, await run_in_threadpool(_tokenize_inputs, ctx, [body.prompt], False), None)
    return {"embedding": vector.float().tolist()}


def ollama_router(ctx: ServerContext) -> APIRouter:
    router = APIRouter(prefix="/api", route_class=OffLoopBodyRoute)
    digest = ModelDigest(ctx)

    @router.post("/chat")
    async def chat(request: Request, body: OllamaChatRequest):
        return await cancel_on_disconnect(request, ollama_chat(ctx, body))

    @router.post("/generate")
    async def generate(request: Request, body: OllamaGenerateRequest):
        return await cancel_on_disconnect(request, ollama_generate(ctx, body))

    @router.post("/embed")
    async def embed(request: Request, body: OllamaEmbedRequest):
        return await cancel_on_disconnect(request, _embed(ctx, body))

    @router.post("/embeddings")
    async def embeddings(request: Request, body: OllamaEmbeddingsRequest):
        return await cancel_on_disconnect(request, _embeddings(ctx, body))

    @router.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @router.get("/tags")
    async def tags() -> dict:
        return {"models": [await _listing(ctx, digest)]}

    @router.get("/ps")
    async def ps() -> dict:
        card = _card(ctx)
        entry = {**await _listing(ctx, digest), "expires_at": iso_time(card.loaded_at + KEEP_LOADED), "size_vram": 0,
                 "size": card.resident_bytes or card.size_bytes, "context_length": card.context_length}  # fmt: skip
        return {"models": [entry]}

    @router.post("/show")
    async def show(body: OllamaModelRequest) -> dict:
        check_ollama_model(ctx, body.model_name)
        card = _card(ctx)
        family = card.family
        info = {"general.architecture": family, "general.parameter_count": card.parameter_count,
                f"{family}.context_length": card.context_length,
                f"{family}.embedding_length": card.embedding_length}  # fmt: skip
        return {"modelfile": "", "parameters": "", "template": ctx.tokenizer.chat_template or "",
                "details": card.details(), "model_info": info, "capabilities": _capabilities(ctx),
                "modified_at": card.modified_at}  # fmt: skip

    @router.post("/pull")
    async def pull(body: OllamaModelRequest):
        # The served model is already here; pulling another would not change what this server runs.
        check_ollama_model(ctx, body.model_name)
        card = _card(ctx)
        steps = [{"status": f"{card.name} is already here", "digest": f"sha256:{await digest.get()}",
                  "total": card.size_bytes, "completed": card.size_bytes}, {"status": "success"}]  # fmt: skip
        if not body.stream:
            return steps[-1]

        async def lines():
            for step in steps:
                yield json.dumps(step) + "\n"

        return StreamingResponse(lines(), media_type=NDJSON)

    return router
