"""What the routes ask of the server's models, whether it serves one (`OneModel`: loaded at start-up,
held for the server's life, today's `folio serve MODEL`) or many (model_manager.ModelManager: loaded
when a request names them, unloaded when idle).

A route opens `models.use(name)` around its handler: the model's `ServerContext`, loaded first if need
be, and held (never unloaded) until the handler returns; a streamed answer then holds it through its
admission slots until the stream ends.
"""

from __future__ import annotations

import math
import re
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

from folio.server.adapters import AdapterTable, LoRAModule
from folio.server.context import ServerContext
from folio.server.created_models import CreatedModel, ModelPreset
from folio.server.engine_client.protocol import EngineClient
from folio.server.errors import APIError
from folio.server.model_card import ModelCard
from folio.server.model_sources import LATEST

_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def keep_alive_seconds(value: float | str) -> float | None:
    """Ollama's keep_alive: seconds as a number, or a Go duration ("5m", "1h30m", "300ms"; a bare number
    is seconds). 0 unloads the model once the request is done; a negative value keeps it loaded for good
    (None)."""
    if isinstance(value, bool):
        raise ValueError(f"keep_alive must be a duration such as '5m' or a number of seconds, got {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        text = value.strip()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        try:
            seconds = sign * float(body)
        except ValueError:
            parts = _DURATION.findall(body)
            if not body or "".join(number + unit for number, unit in parts) != body:
                raise ValueError(f"keep_alive must be a duration such as '5m' or '1h30m', or a number of seconds, "
                                 f"got {value!r}") from None  # fmt: skip
            seconds = sign * sum(float(number) * _UNIT_SECONDS[unit] for number, unit in parts)
    if not math.isfinite(seconds):
        raise ValueError(f"keep_alive must be finite, got {value!r}")
    return None if seconds < 0 else seconds


def requested_keep_alive(value: float | str) -> float | None:
    """A request's keep_alive, or a 400 that names the field."""
    try:
        return keep_alive_seconds(value)
    except ValueError as exc:
        raise APIError(400, str(exc), param="keep_alive") from None


@dataclass(frozen=True)
class ModelStatus:
    """One servable model, as the listing routes (/v1/models, /models, /api/tags, /api/ps) show it."""

    name: str
    state: str  # "loaded", "loading", "unloaded" or "failed" (llama-server's values)
    origin: str  # "argument", "models_dir" or "pulled"
    card: ModelCard | None = None  # known once the model has loaded
    expires_at: float | None = None  # when an idle loaded model is unloaded; None: never
    error: str | None = None  # why its last load failed
    parent: str | None = None  # a LoRA adapter's base model

    @property
    def loaded(self) -> bool:
        return self.state == "loaded"


class ServedModels(Protocol):
    @property
    def is_alive(self) -> bool:
        """False once the server cannot serve at all (/health then answers 503)."""
        ...

    def use(
        self, name: str | None, keep_alive: float | str | None = None
    ) -> AbstractAsyncContextManager[ServerContext]:
        """The named model's context, loaded first if need be (None: the only model, or the only loaded
        one). Unknown names are a 404; `keep_alive`, as Ollama's field, sets how long the model stays
        loaded once idle."""
        ...

    @property
    def loads_on_demand(self) -> bool:
        """Whether models load, unload, are pulled and deleted while serving (not so for one model held for
        the server's life)."""
        ...

    def statuses(self) -> list[ModelStatus]: ...

    async def card(self, name: str) -> ModelCard | None:
        """What the named model's files say (read once, off the event loop); None where it is not on this
        machine yet (a catalog name not pulled)."""
        ...

    async def load(self, name: str) -> None: ...

    async def unload(self, name: str) -> bool:
        """Unload the named model once its requests are done; False if it was not loaded."""
        ...

    async def delete(self, name: str) -> None:
        """Unload the named model and delete its files (only a catalog model folio pulled)."""
        ...

    async def load_adapter(self, name: str, path: str, base: str | None = None) -> None:
        """Register a LoRA adapter (a PEFT folder on this machine) on the `base` model (None: the only one),
        which requests then name as their model."""
        ...

    async def unload_adapter(self, name: str) -> None: ...

    async def create(
        self, name: str, source: str, preset: ModelPreset, adapter_files: dict[str, Path] | None = None
    ) -> None:
        """Make (or remake) the model `name` from `source` with `preset` and an adapter's files (Ollama's
        /api/create and /api/copy)."""
        ...

    def created(self, name: str) -> CreatedModel | None:
        """The created model of that name, if it is one."""
        ...


def model_not_found(name: str, served: list[str]) -> APIError:
    listed = ", ".join(f"'{n}'" for n in served[:20]) + (", ..." if len(served) > 20 else "") or "none yet"
    return APIError(404, f"The model '{name}' does not exist: not found among this server's models ({listed})",
                    param="model", code="model_not_found")  # fmt: skip


ONE_MODEL = (
    "this server holds its one model for its whole life; serve several models (or --models-dir, or "
    "none: every pulled model) to load, unload, create and delete them"
)


class OneModel:
    """One model loaded for the server's whole life, and the LoRA adapters registered on it: a request that
    names an adapter gets the model's context with the adapter set (the same engine and admission)."""

    def __init__(self, ctx: ServerContext, adapters: AdapterTable | None = None) -> None:
        self.context = ctx
        self.adapters = adapters or AdapterTable([], runtime=False)
        for adapter in self.adapters:
            if adapter.base_model_name not in (None, ctx.model_name):
                raise ValueError(f"the LoRA adapter {adapter.name!r} names {adapter.base_model_name!r} as its base "
                                 f"model; this server serves {ctx.model_name!r}")  # fmt: skip

    @property
    def is_alive(self) -> bool:
        return self.context.engine.is_alive

    @property
    def loads_on_demand(self) -> bool:
        return False

    def _context(self, name: str | None) -> ServerContext:
        base = self.context.model_name
        if name is None or base in (name, name.removesuffix(LATEST)):
            return self.context
        adapter = self.adapters.get(name)
        if adapter is not None:
            return replace(self.context, model_name=adapter.name, lora_name=adapter.name)
        raise model_not_found(name, [base, *(a.name for a in self.adapters)])

    @asynccontextmanager
    async def use(self, name: str | None, keep_alive: float | str | None = None) -> AsyncIterator[ServerContext]:
        context = self._context(name)
        if keep_alive is not None:
            requested_keep_alive(keep_alive)  # checked, though this model stays loaded whatever it says
        yield context

    def statuses(self) -> list[ModelStatus]:
        base = ModelStatus(self.context.model_name, "loaded", "argument", self.context.model_card)
        return [base, *(ModelStatus(a.name, "loaded", "adapter", parent=base.name) for a in self.adapters)]

    async def card(self, name: str) -> ModelCard | None:
        self._context(name)
        return self.context.model_card

    async def load(self, name: str) -> None:
        self._context(name)

    async def unload(self, name: str) -> bool:
        self._context(name)
        raise APIError(400, ONE_MODEL, param="model")

    async def delete(self, name: str) -> None:
        self._context(name)
        raise APIError(400, ONE_MODEL, param="model")

    async def create(
        self, name: str, source: str, preset: ModelPreset, adapter_files: dict[str, Path] | None = None
    ) -> None:  # fmt: skip
        self._context(source)
        raise APIError(400, ONE_MODEL, param="model")

    def created(self, name: str) -> CreatedModel | None:
        return None

    async def load_adapter(self, name: str, path: str, base: str | None = None) -> None:
        self.adapters.require_runtime()
        model = self.context.model_name
        if name.removesuffix(LATEST) == model:
            raise APIError(400, f"'{name}' is the base model's name", param="lora_name")
        if base is not None and base.removesuffix(LATEST) != model:
            raise model_not_found(base, [model])
        await add_adapter(self.context.engine, LoRAModule(name, path, model))
        self.adapters.add(LoRAModule(name, path, model))

    async def unload_adapter(self, name: str) -> None:
        self.adapters.require_runtime()
        adapter = self.adapters.known(name)
        await remove_adapter(self.context.engine, adapter.name)
        self.adapters.remove(adapter.name)


async def add_adapter(engine: EngineClient, adapter: LoRAModule) -> None:
    """Register the adapter in the engine, or the API's 400 naming why it cannot serve it."""
    try:
        await engine.add_lora(adapter.request)
    except ValueError as exc:
        raise APIError(400, str(exc), param="lora_path") from None


async def remove_adapter(engine: EngineClient, name: str) -> None:
    try:
        await engine.remove_lora(name)
    except ValueError as exc:  # requests still run with it
        raise APIError(400, str(exc), param="lora_name") from None
