"""The many-model server's models: loaded when a request names one, unloaded when idle, as Ollama and
llama-server's router mode do.

Each loaded model runs its engine in a process of its own (engine_client/process.py), so one model's
loading, unloading or crash never stalls another's requests: the event loop only awaits a load, which
runs on a thread of the manager's own. At most `max_loaded` models are loaded (or loading) at once; to
load another, the least recently used idle model is unloaded first. A model is idle when no route holds
it and no request of its is admitted, and a model that is not idle is never unloaded: a load that finds
every model busy waits for one (bounded in time and in the number of waiters), then answers 503.

An idle model is unloaded `keep_alive` seconds after its last request ended (Ollama's field, per
request; the server's default otherwise). An engine that died is dropped at once (its requests fail
with 503) and loaded anew by the next request that names it.

All the manager's state lives on the event loop; only the loads and unloads themselves run on threads.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path

from folio.engine_args import EngineArgs
from folio.loaders import catalog
from folio.loaders.catalog import CATALOG
from folio.paths import folio_home
from folio.server.adapters import AdapterTable, LoRAModule
from folio.server.context import ServerContext
from folio.server.created_models import CreatedModel, CreatedModels, ModelPreset
from folio.server.engine_client.process import ProcessEngine, StartCancelled
from folio.server.engine_starts import EngineStarter
from folio.server.errors import APIError
from folio.server.model_budget import LoadedModel, MakeContext, ManagerOptions, engine_args_for, estimate_bytes
from folio.server.model_card import ModelCard
from folio.server.model_sources import LATEST, ModelSource, ModelSources
from folio.server.model_variants import Variants
from folio.server.served_models import ModelStatus, model_not_found, requested_keep_alive

logger = logging.getLogger("folio")

REAP_INTERVAL_S = 0.25  # how often idle models are checked against their keep_alive
ROOM_POLL_S = 0.1  # how often a load waiting for room looks again


class ModelManager:
    def __init__(
        self, sources: ModelSources, base_args: EngineArgs, make_context: MakeContext,
        options: ManagerOptions | None = None, adapters: AdapterTable | None = None,
        created: CreatedModels | None = None,
    ) -> None:  # fmt: skip
        self.sources = sources
        self.adapters = adapters or AdapterTable([], runtime=False)  # each on a base model named in sources
        self.variants = Variants(sources, self.adapters, created or CreatedModels(folio_home() / "created"))
        self.base_args = base_args
        self.make_context = make_context
        self.options = options or ManagerOptions()
        self._loaded: dict[str, LoadedModel] = {}
        self._loading: dict[str, asyncio.Future[LoadedModel]] = {}
        self._failed: dict[str, str] = {}
        self._cards: dict[tuple[str, str, int, int], ModelCard] = {}  # unloaded models', by file and version
        self._claims: dict[str, int] = {}  # requests awaiting each load
        self._starting: dict[str, int] = {}  # loads past _make_room, not yet loaded: their estimated bytes
        self._stopping: set[LoadedModel] = set()  # unloaded, their engines still stopping
        self._waiting = 0
        self._cancel = threading.Event()  # set at shutdown: loads in progress stop
        self._threads = ThreadPoolExecutor(max_workers=self.options.max_loaded + 3, thread_name_prefix="folio-models")
        self.starter = EngineStarter(self._threads, self._cancel, self.options.spare_engine)
        self._reaper: asyncio.Task[None] | None = None

    # -- ServedModels ----------------------------------------------------------------------------------
    @property
    def is_alive(self) -> bool:
        return not self._cancel.is_set()

    @property
    def loads_on_demand(self) -> bool:
        return True

    @asynccontextmanager
    async def use(self, name: str | None, keep_alive: float | str | None = None) -> AsyncIterator[ServerContext]:
        seconds = self.options.keep_alive if keep_alive is None else requested_keep_alive(keep_alive)
        model = await self._acquire(self._resolve(self.variants.base_of(name)))
        try:
            yield self.variants.context(name, model.context)
        finally:
            model.leases -= 1
            model.last_used = time.monotonic()
            if keep_alive is not None:
                model.keep_alive = seconds

    def statuses(self) -> list[ModelStatus]:
        statuses = []
        for name, source in self.sources.available().items():
            model = self._loaded.get(name)
            if model is not None and model.engine.is_alive:
                expires = model.expires_at()
                wall = None if expires is None else time.time() + (expires - time.monotonic())
                statuses.append(ModelStatus(name, "loaded", source.origin, model.context.model_card, wall))
            elif name in self._loading:
                statuses.append(ModelStatus(name, "loading", source.origin))
            elif name in self._failed:
                statuses.append(ModelStatus(name, "failed", source.origin, error=self._failed[name]))
            else:
                statuses.append(ModelStatus(name, "unloaded", source.origin))
        return self.variants.statuses(statuses)

    async def card(self, name: str) -> ModelCard | None:
        source = self._resolve(self._model_of(name))
        model = self._loaded.get(source.name)
        if model is not None and model.context.model_card is not None:
            return model.context.model_card
        path = await asyncio.to_thread(source.local_path)
        if path is None:
            return None
        stat = path.stat()
        key = (source.name, str(path), stat.st_mtime_ns, stat.st_size)
        if key not in self._cards:
            try:
                self._cards[key] = await asyncio.to_thread(ModelCard.read, source.name, path)
            except (ValueError, KeyError, OSError) as exc:  # a file folio cannot read: listed without a card
                logger.warning("cannot describe %s (%s): %s", source.name, path, exc)
                return None
        return self._cards[key]

    async def load(self, name: str) -> None:
        model = await self._acquire(self._resolve(self._model_of(name)))
        model.leases -= 1
        model.last_used = time.monotonic()

    async def unload(self, name: str) -> bool:
        source = self._resolve(self._model_of(name))
        model = self._loaded.get(source.name)
        if model is None:
            return False
        model.keep_alive = 0.0  # the reaper unloads it once its requests are done
        await self._reap_once()
        return True

    async def delete(self, name: str) -> None:
        created = self.variants.created_model(name)
        if created is not None:
            await self.variants.drop_created(created, self._loaded.get)
            return
        if self.adapters.get(name) is not None:
            raise APIError(400, f"'{name}' is a LoRA adapter: unload it with /v1/unload_lora_adapter", param="model")
        source = self._resolve(name)
        if source.spec not in CATALOG:
            raise APIError(400, f"'{source.name}' is {source.spec}, not a model folio pulled: delete its files "
                           "yourself", param="model")  # fmt: skip
        await self.unload(source.name)  # its engine keeps the open file until its requests are done
        if not await asyncio.to_thread(catalog.remove, source.spec):
            raise APIError(404, f"model '{name}' not found: it is not pulled", param="model")

    async def load_adapter(self, name: str, path: str, base: str | None = None) -> None:
        """Load the base model (if it is not), register the adapter in its engine, then list it; the
        adapter is registered again each time the base loads."""
        self.variants.check_new_adapter(name, base)
        model = await self._acquire(self._resolve(base))
        try:
            await self.variants.register(model, LoRAModule(name, path, model.name))
        finally:
            model.leases -= 1

    async def unload_adapter(self, name: str) -> None:
        await self.variants.unregister(name, self._loaded.get)

    async def create(
        self, name: str, source: str, preset: ModelPreset, adapter_files: dict[str, Path] | None = None
    ) -> None:  # fmt: skip
        await self.variants.create(name, source, preset, adapter_files, self._loaded.get, self.unload)

    def created(self, name: str) -> CreatedModel | None:
        return self.variants.created_model(name)

    # -- loading ---------------------------------------------------------------------------------------
    def _model_of(self, name: str) -> str:
        """The model a name loads: an adapter's or created model's base, or the model itself."""
        return self.variants.base_of(name) or name

    def _resolve(self, name: str | None) -> ModelSource:
        # A loaded model answers without reading the folder or folio's home again (every request asks).
        loaded = self._loaded.get(name) or self._loaded.get(name.removesuffix(LATEST)) if name else None
        if loaded is not None:
            return loaded.source
        available = self.sources.available()
        if name is None:
            loaded = [n for n in self._loaded if n in available]
            only = list(available) if len(available) == 1 else loaded if len(loaded) == 1 else []
            if not only:
                raise APIError(400, f"this server serves several models: name one ({', '.join(available)})",
                               param="model")  # fmt: skip
            return available[only[0]]
        source = available.get(name) or available.get(name.removesuffix(LATEST))
        if source is None:
            raise model_not_found(name, [*available, *(status.name for status in self.variants.statuses([]))])
        return source

    async def _acquire(self, source: ModelSource) -> LoadedModel:
        """The model, loaded, with a lease taken for the caller (who gives it back: `leases -= 1`)."""
        self._start_reaper()
        while True:
            model = self._loaded.get(source.name)
            if model is not None and model.engine.is_alive and model.source == source:
                model.leases += 1
                return model
            if model is not None:  # its engine died, or the name now means another file: load it anew
                await self._drop(model)
                continue
            loading = self._loading.get(source.name)
            if loading is None:
                loading = self._loading[source.name] = asyncio.ensure_future(self._load(source))
            # Claimed while awaited, so that no other load unloads it between its arrival and the lease.
            # Shielded: a client that leaves does not call off a load that others (or it, retrying) await.
            self._claims[source.name] = self._claims.get(source.name, 0) + 1
            try:
                await asyncio.shield(loading)
            finally:
                self._claims[source.name] -= 1

    def _evictable(self, model: LoadedModel) -> bool:
        return not model.engine.is_alive or (model.idle and not self._claims.get(model.name))

    def engine_args(self, source: ModelSource) -> EngineArgs:
        lora = self.adapters.runtime or bool(self.adapters.on(source.name))
        return engine_args_for(source, self.base_args, self.options, lora)

    async def _load(self, source: ModelSource) -> LoadedModel:
        args = self.engine_args(source)
        estimate = await asyncio.to_thread(self.estimate_bytes, source, args)
        started = False
        try:
            await self._make_room(source.name, estimate)
            started = True  # counted in _starting by _make_room
            self._failed.pop(source.name, None)
            logger.info("loading %s (%s)", source.name, source.spec)
            start = time.perf_counter()
            loop = asyncio.get_running_loop()
            try:
                engine = await loop.run_in_executor(self._threads, self._start_engine, args, source.name)
            except (ValueError, RuntimeError, OSError) as exc:
                if isinstance(exc, StartCancelled):
                    raise APIError(503, "the server is stopping", code="shutting_down") from None
                self._failed[source.name] = str(exc)
                raise APIError(500, f"model '{source.name}' failed to load: {exc}", param="model",
                               code="model_load_failed") from None  # fmt: skip
            await self._register_adapters(engine, source.name)
            context = self.make_context(engine, engine.info, source.name)
            model = LoadedModel(source, engine, context, self.options.keep_alive, estimate, args.enable_lora)
            self._loaded[source.name] = model
            logger.info("loaded %s in %.1f s (engine in process %d)", source.name, time.perf_counter() - start,
                        engine.process.pid)  # fmt: skip
            return model
        finally:
            del self._loading[source.name]
            if started:
                self._starting.pop(source.name)

    async def _register_adapters(self, engine: ProcessEngine, base: str) -> None:
        """The base's adapters into its new engine. One it cannot serve (its folder changed since) is
        dropped with a warning rather than failing the base model."""
        for adapter in self.adapters.on(base):
            try:
                await engine.add_lora(adapter.request)
            except ValueError as exc:
                logger.warning("dropping the LoRA adapter %s: %s", adapter.name, exc)
                self.adapters.remove(adapter.name)

    def estimate_bytes(self, source: ModelSource, args: EngineArgs) -> int:
        return estimate_bytes(source, args)

    def _start_engine(self, args: EngineArgs, name: str) -> ProcessEngine:
        return self.starter.start(args, name)

    def _fits(self, estimate: int) -> bool:
        if not self._room_in_number():
            return False
        budget = self.options.memory_budget
        used = sum(m.resident_bytes for m in (*self._loaded.values(), *self._stopping)) + sum(self._starting.values())
        return budget is None or used + estimate <= budget

    def _room_in_number(self) -> bool:
        return len(self._loaded) + len(self._starting) < self.options.max_loaded

    async def _make_room(self, name: str, estimate: int) -> None:
        """Unload least recently used idle models until one more fits (in number and in memory), and count
        it as starting; wait while the models in its way are busy."""
        budget = self.options.memory_budget
        if budget is not None and estimate > budget:
            raise APIError(500, f"model '{name}' needs about {estimate / 2**30:.1f} GiB (weights and KV cache), more "
                           f"than the models' memory budget of {budget / 2**30:.1f} GiB (--models-memory)",
                           param="model", code="insufficient_memory")  # fmt: skip
        deadline = time.monotonic() + self.options.room_timeout
        waiting = False
        try:
            while not self._fits(estimate):
                if self._stopping and self._room_in_number():
                    await asyncio.sleep(ROOM_POLL_S)  # short of memory that engines stopping give back soon
                    continue
                idle = [m for m in self._loaded.values() if self._evictable(m)]
                if idle:  # its engine stops while this one loads (its memory counted until it has)
                    await self._drop(min(idle, key=lambda m: m.last_used), wait=False)
                    continue
                if not waiting:
                    if self._waiting >= self.options.max_waiting:
                        raise APIError(429, f"{self._waiting} requests already wait for a model's place; retry "
                                       "shortly", code="queue_full", headers={"Retry-After": "5"})  # fmt: skip
                    waiting = True
                    self._waiting += 1
                if time.monotonic() >= deadline:
                    busy = ", ".join(sorted(self._loaded))
                    raise APIError(503, f"cannot load '{name}': the models loaded or loading ({busy}) are busy and "
                                   "leave it no room", code="models_busy", headers={"Retry-After": "5"})  # fmt: skip
                await asyncio.sleep(ROOM_POLL_S)
            self._starting[name] = estimate
        finally:
            if waiting:
                self._waiting -= 1

    async def _drop(self, model: LoadedModel, wait: bool = True) -> None:
        """Unload it: at once from the loaded models; its engine stopped on a thread (awaited, or not)."""
        if self._loaded.get(model.name) is model:
            del self._loaded[model.name]
        reason = "its engine died" if not model.engine.is_alive else "idle"
        logger.info("unloading %s (%s)", model.name, reason)
        self._stopping.add(model)
        stopped = asyncio.get_running_loop().run_in_executor(self._threads, model.engine.shutdown)
        stopped.add_done_callback(lambda _: self._stopping.discard(model))
        if wait:
            await stopped

    async def stops_done(self) -> None:
        """Until every engine being stopped has stopped."""
        while self._stopping:
            await asyncio.sleep(0.01)

    # -- idle unloads ----------------------------------------------------------------------------------
    def _start_reaper(self) -> None:
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.ensure_future(self._reap())

    async def _reap(self) -> None:
        while not self._cancel.is_set():
            await self._reap_once()
            await asyncio.sleep(REAP_INTERVAL_S)

    async def _reap_once(self) -> None:
        now = time.monotonic()
        for model in list(self._loaded.values()):
            if not model.engine.is_alive:
                await self._drop(model)
            elif not self._evictable(model):
                model.last_used = now  # its keep_alive counts from the end of its last request
            elif (expires := model.expires_at()) is not None and now >= expires:
                await self._drop(model)

    # -- the server's end ------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop loads in progress and every engine (blocking; after the event loop has stopped)."""
        self._cancel.set()
        self.starter.stop()
        engines = [model.engine for model in self._loaded.values()]
        self._loaded.clear()
        for engine in engines:
            self._threads.submit(engine.shutdown)
        self._threads.shutdown(wait=True)

    # -- metrics ---------------------------------------------------------------------------------------
    def metrics_texts(self) -> list[str]:
        """Each loaded engine's metrics (asked for now: call off the event loop)."""
        return [model.engine.metrics_text() for model in list(self._loaded.values())]

    def admissions(self) -> Iterator[tuple[str, int]]:
        for model in list(self._loaded.values()):
            yield model.name, model.context.admission.in_flight
