"""Ollama's native API on the same engines: apps written for Ollama work by changing only the port.

/api/chat and /api/generate (ollama_chat.py), /api/embed and /api/embeddings (the vectors of
/v1/embeddings), and the model routes: /api/tags lists every model the server can serve, /api/ps the
loaded ones (with when each is unloaded), /api/show describes one, /api/pull fetches a catalog model
into folio's home (its progress streamed as Ollama's lines; one already here succeeds at once),
/api/delete removes one folio pulled, /api/version gives folio's version. A request's `keep_alive` sets
how long its model stays loaded once idle; a load-only request (no prompt, no messages) with keep_alive
0 unloads it, as `ollama stop` does. Errors come as Ollama's `{"error": "..."}` (errors.py picks the format by path)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from folio import __version__
from folio.loaders import catalog
from folio.loaders.catalog import CATALOG, ModelSourceError
from folio.reasoning import reasoning_enabled
from folio.server.body_route import OffLoopBodyRoute
from folio.server.context import ServerContext
from folio.server.created_models import CreatedModel
from folio.server.errors import APIError
from folio.server.lifetime import cancel_on_disconnect
from folio.server.model_card import ModelCard, iso_time
from folio.server.model_sources import LATEST
from folio.server.ollama.chat import NDJSON, ollama_chat, ollama_generate
from folio.server.ollama.protocol import (
    GeneratingBody,
    OllamaChatRequest,
    OllamaEmbeddingsRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
    OllamaModelRequest,
)
from folio.server.openai.embeddings import embed_inputs
from folio.server.served_models import ServedModels, requested_keep_alive

KEEP_LOADED = 10 * 365 * 24 * 3600  # /api/ps's expires_at for a model that stays loaded while the server runs


class ModelDigests:
    """Each model file's sha256, hashed once on a worker thread per file version; calls that come while
    it is being hashed wait for that one hashing. A file that cannot be read (deleted while serving) is a
    503, and the next call tries again."""

    def __init__(self) -> None:
        self._hashing: dict[tuple[str, str], asyncio.Future[str]] = {}

    async def get(self, card: ModelCard) -> str:
        key = (str(card.path), card.modified_at)
        hashing = self._hashing.get(key)
        if hashing is None:
            hashing = self._hashing[key] = asyncio.ensure_future(run_in_threadpool(card.compute_digest))
        try:
            return await asyncio.shield(hashing)  # a caller that leaves does not cancel the others' hashing
        except OSError as exc:
            self._hashing.pop(key, None)
            raise APIError(503, f"the model file can no longer be read ({exc.strerror or type(exc).__name__}); "
                           "its digest is unknown") from None  # fmt: skip


async def _listing(card: ModelCard, digests: ModelDigests) -> dict[str, Any]:
    return {"name": card.name, "model": card.name, "modified_at": card.modified_at, "size": card.size_bytes,
            "digest": await digests.get(card), "details": card.details()}  # fmt: skip


def _created_fields(created: CreatedModel) -> dict[str, Any]:
    """/api/show's account of a created model: its Modelfile, as Ollama writes one back."""
    preset = created.preset
    lines = [f"FROM {created.base}"]
    if created.adapter is not None:
        lines.append(f"ADAPTER {created.adapter}")
    parameters = [f"{name} {json.dumps(v) if isinstance(v, str) else v}" for name, value in preset.parameters.items()
                  for v in (value if isinstance(value, list) else [value])]  # fmt: skip
    lines += [f"PARAMETER {line}" for line in parameters]
    for keyword, text in (("TEMPLATE", preset.template), ("SYSTEM", preset.system), ("LICENSE", preset.license)):
        if text is not None:
            lines.append(f'{keyword} """{text}"""')
    lines += [f"MESSAGE {m['role']} {m['content']}" for m in preset.messages]
    fields: dict[str, Any] = {"modelfile": "\n".join(lines) + "\n", "parameters": "\n".join(parameters),
                              "messages": list(preset.messages)}  # fmt: skip
    for name in ("template", "system", "license"):
        if getattr(preset, name) is not None:
            fields[name] = getattr(preset, name)
    return fields


def _capabilities(ctx: ServerContext) -> list[str]:
    capabilities = ["completion", "tools", "embedding"]
    if reasoning_enabled(ctx.chat.reasoning_parser, ctx.tokenizer.chat_template):
        capabilities.append("thinking")
    return capabilities


async def _embed(ctx: ServerContext, body: OllamaEmbedRequest) -> dict:
    start = time.perf_counter_ns()
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
    body.options.check_extras()
    [vector] = await embed_inputs(ctx, await run_in_threadpool(_tokenize_inputs, ctx, [body.prompt], False), None)
    return {"embedding": vector.float().tolist()}


async def _already_here(card: ModelCard, digest: str) -> AsyncIterator[dict[str, Any]]:
    yield {"status": f"{card.name} is already here", "digest": f"sha256:{digest}", "total": card.size_bytes,
           "completed": card.size_bytes}  # fmt: skip
    yield {"status": "success"}


async def pull_steps(name: str) -> AsyncIterator[dict[str, Any]]:
    """A catalog model pulled into folio's home on a thread of its own, its steps as Ollama's /api/pull
    lines (each step's bytes at most ten times a second), then "success" or {"error": ...}. A client that
    leaves does not stop the pull: the next one finds it done."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    last = {"status": "", "at": 0.0}

    def report(status: str, total: int, completed: int) -> None:
        now = time.monotonic()
        if status == last["status"] and now - float(last["at"]) < 0.1 and completed < total:  # a step's end goes
            return
        last.update(status=status, at=now)
        step: dict[str, Any] = {"status": status}
        if total:
            step.update(total=total, completed=completed)
        loop.call_soon_threadsafe(queue.put_nowait, step)

    def work() -> None:
        try:
            catalog.pull(name, report)
            end: dict[str, Any] = {"status": "success"}
        except (ModelSourceError, OSError) as exc:
            end = {"error": f"pulling {name}: {exc}"}
        loop.call_soon_threadsafe(queue.put_nowait, end)
        loop.call_soon_threadsafe(queue.put_nowait, None)

    threading.Thread(target=work, name=f"folio-pull-{name}", daemon=True).start()
    while (step := await queue.get()) is not None:
        yield step


def _load_only(body: GeneratingBody) -> bool:
    if isinstance(body, OllamaChatRequest):
        return not body.messages
    assert isinstance(body, OllamaGenerateRequest)
    return not body.prompt and not body.context


def ollama_router(models: ServedModels) -> APIRouter:
    router = APIRouter(prefix="/api", route_class=OffLoopBodyRoute)
    digests = ModelDigests()

    async def generating(body: OllamaChatRequest | OllamaGenerateRequest) -> Any:
        stop = _load_only(body) and body.keep_alive is not None and models.loads_on_demand
        if stop and requested_keep_alive(body.keep_alive) == 0:  # `ollama stop`: unloaded, not loaded first
            await models.unload(body.model)
            chat = isinstance(body, OllamaChatRequest)
            part = {"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}
            created = datetime.now(UTC).isoformat().replace("+00:00", "Z")
            return {"model": body.model, "created_at": created, **part, "done": True, "done_reason": "unload"}
        async with models.use(body.model, body.keep_alive) as ctx:
            if isinstance(body, OllamaChatRequest):
                return await ollama_chat(ctx, body)
            return await ollama_generate(ctx, body)

    @router.post("/chat")
    async def chat(request: Request, body: OllamaChatRequest):
        return await cancel_on_disconnect(request, generating(body))

    @router.post("/generate")
    async def generate(request: Request, body: OllamaGenerateRequest):
        return await cancel_on_disconnect(request, generating(body))

    async def embedding(body: OllamaEmbedRequest | OllamaEmbeddingsRequest) -> dict:
        async with models.use(body.model, body.keep_alive) as ctx:
            return await (_embed(ctx, body) if isinstance(body, OllamaEmbedRequest) else _embeddings(ctx, body))

    @router.post("/embed")
    async def embed(request: Request, body: OllamaEmbedRequest):
        return await cancel_on_disconnect(request, embedding(body))

    @router.post("/embeddings")
    async def embeddings(request: Request, body: OllamaEmbeddingsRequest):
        return await cancel_on_disconnect(request, embedding(body))

    @router.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    async def card(name: str) -> ModelCard:
        found = await models.card(name)
        if found is None:
            raise APIError(404, f"model '{name}' is not on this machine yet; pull it first")
        return found

    @router.get("/tags")
    async def tags() -> dict:
        listed = []
        for status in models.statuses():
            found = await models.card(status.name)
            if found is not None:  # a catalog name not pulled yet is not listed, as in Ollama
                # A LoRA adapter is listed under its own name, with its base model's details.
                listed.append(await _listing(replace(found, name=status.name), digests))
        return {"models": listed}

    @router.get("/ps")
    async def ps() -> dict:
        running = []
        for status in models.statuses():
            if not status.loaded or status.card is None:
                continue
            found = status.card
            expires = time.time() + KEEP_LOADED if status.expires_at is None else status.expires_at
            running.append({**await _listing(found, digests), "expires_at": iso_time(expires), "size_vram": 0,
                            "size": found.resident_bytes or found.size_bytes,
                            "context_length": found.context_length})  # fmt: skip
        return {"models": running}

    @router.post("/show")
    async def show(body: OllamaModelRequest) -> dict:
        found = await card(body.model_name)
        family = found.family
        info = {"general.architecture": family, "general.parameter_count": found.parameter_count,
                f"{family}.context_length": found.context_length,
                f"{family}.embedding_length": found.embedding_length}  # fmt: skip
        loaded = next((s for s in models.statuses() if s.name == found.name and s.loaded), None)
        template, capabilities = "", ["completion", "tools", "embedding"]
        if loaded is not None:
            async with models.use(found.name) as ctx:
                template, capabilities = ctx.tokenizer.chat_template or "", _capabilities(ctx)
        shown = {"modelfile": "", "parameters": "", "template": template, "details": found.details(),
                 "model_info": info, "capabilities": capabilities, "modified_at": found.modified_at}  # fmt: skip
        created = models.created(body.model_name)
        return {**shown, **_created_fields(created)} if created is not None else shown

    @router.post("/pull")
    async def pull(body: OllamaModelRequest):
        name = body.model_name.removesuffix(LATEST)
        if models.loads_on_demand and name in CATALOG:
            steps = pull_steps(name)
        else:  # a model already here (one this server serves); nothing to fetch
            found = await card(body.model_name)
            steps = _already_here(found, await digests.get(found))
        if body.stream:
            return StreamingResponse((json.dumps(step) + "\n" async for step in steps), media_type=NDJSON)
        seen = [step async for step in steps]
        if "error" in seen[-1]:
            raise APIError(500, seen[-1]["error"])
        return seen[-1]

    @router.delete("/delete")
    async def delete(body: OllamaModelRequest) -> Response:
        await models.delete(body.model_name)
        return Response(status_code=200)

    return router
