"""The routes that list, load and unload models: OpenAI's /v1/models (with llama-server's fields, so its
router-mode clients read it too, and vLLM's `parent` on LoRA adapters), llama-server's /models,
/models/load and /models/unload, and vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import Field

from folio.server.body_route import OffLoopBodyRoute
from folio.server.request_body import RequestBody
from folio.server.served_models import ModelStatus, ServedModels


class ModelNameRequest(RequestBody):
    model: str


class LoadLoRARequest(RequestBody):
    """vLLM's body for /v1/load_lora_adapter."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False  # a known name is replaced either way
    base_model_name: str | None = Field(None, min_length=1)  # the served model it adapts; needed among several


class UnloadLoRARequest(RequestBody):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # vLLM's numeric id: folio names adapters only


def model_entry(status: ModelStatus) -> dict[str, Any]:
    entry: dict[str, Any] = {"id": status.name, "object": "model", "created": 0, "owned_by": "folio",
                             "status": {"value": status.state}, "source": status.origin}  # fmt: skip
    if status.error is not None:
        entry["status"]["error"] = status.error
    if status.parent is not None:  # a LoRA adapter, as vLLM lists one
        entry["parent"] = status.parent
    card = status.card
    if card is not None:
        entry["created"] = int(card.loaded_at)
        entry["max_model_len"] = card.context_length
        if card.resident_bytes is not None:
            entry["memory_bytes"] = card.resident_bytes
    return entry


def model_router(models: ServedModels) -> APIRouter:
    router = APIRouter(route_class=OffLoopBodyRoute)

    @router.get("/v1/models")
    @router.get("/models")
    async def listing() -> dict:
        return {"object": "list", "data": [model_entry(status) for status in models.statuses()]}

    @router.post("/models/load")
    async def load(body: ModelNameRequest) -> dict:
        """Loaded when this answers (llama-server answers at once and loads behind it)."""
        await models.load(body.model)
        return {"success": True}

    @router.post("/models/unload")
    async def unload(body: ModelNameRequest) -> dict:
        """Unloaded once its requests in flight are done; a model not loaded has nothing to do."""
        await models.unload(body.model)
        return {"success": True}

    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRARequest) -> PlainTextResponse:
        await models.load_adapter(body.lora_name, body.lora_path, body.base_model_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRARequest) -> PlainTextResponse:
        await models.unload_adapter(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    return router
