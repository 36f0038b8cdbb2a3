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
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace

import torch

from folio.config import parse_memory
from folio.engine_args import EngineArgs
from folio.loaders import catalog
from folio.loaders.catalog import CATALOG
from folio.platform import default_device, default_kv_cache_memory
from folio.server.context import ServerContext
from folio.server.engine_client.process import ProcessEngine, StartCancelled
from folio.server.engine_client.wire import EngineInfo
from folio.server.errors import APIError
from folio.server.model_card import ModelCard
from folio.server.model_sources import LATEST, ModelSource, ModelSources
from folio.server.served_models import ModelStatus, model_not_found, requested_keep_alive

logger = logging.getLogger("folio")

REAP_INTERVAL_S = 0.25  # how often idle models are checked against their keep_alive
ROOM_POLL_S = 0.1  # how often a load waiting for room looks again


@dataclass(frozen=True)
class ManagerOptions:
    max_loaded: int = 3  # Ollama's default on a machine without a GPU
    keep_alive: float | None = 300.0  # seconds an idle model stays loaded; None: for good (Ollama's 5 minutes)
    memory_budget: int | None = None  # bytes the loaded models' weights and KV caches may hold; None: no bound
    room_timeout: float = 300.0  # seconds a request waits for a busy model to free its place
    max_waiting: int = 64  # requests waiting for room at once; more get 429

    def __post_init__(self) -> None:
        if self.max_loaded < 1:
            raise ValueError(f"--max-loaded-models must be >= 1, got {self.max_loaded}")
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise ValueError(f"the models' memory budget must be > 0 bytes, got {self.memory_budget}")
        if self.room_timeout < 0 or self.max_waiting < 0:
            raise ValueError("the wait for a loaded model's place must be >= 0 seconds and >= 0 requests")


MakeContext = Callable[[ProcessEngine, EngineInfo, str], ServerContext]


@dataclass
class LoadedModel:
    source: ModelSource
    engine: ProcessEngine
    context: ServerContext
    keep_alive: float | None
    estimate: int  # bytes it was expected to hold before it loaded
    last_used: float = field(default_factory=time.monotonic)
    leases: int = 0  # routes holding it now

    @property
    def name(self) -> str:
        return self.source.name

    @property
    def idle(self) -> bool:
        return self.leases == 0 and self.context.admission.in_flight == 0

    @property
    def resident_bytes(self) -> int:
        """Its weights and KV cache, as the engine reported them once loaded."""
        card = self.context.model_card
        return card.resident_bytes if card is not None and card.resident_bytes is not None else self.estimate

    def expires_at(self) -> float | None:
        """Monotonic time at which it is unloaded if it stays idle; None: never."""
        return None if self.keep_alive is None else self.last_used + self.keep_alive


class ModelManager:
    def __init__(
        self, sources: ModelSources, base_args: EngineArgs, make_context: MakeContext,
        options: ManagerOptions | None = None,
    ) -> None:  # fmt: skip
        self.sources = sources
        self.base_args = base_args
        self.make_context = make_context
        self.options = options or ManagerOptions()
        self._loaded: dict[str, LoadedModel] = {}
        self._loading: dict[str, asyncio.Future[LoadedModel]] = {}
        self._failed: dict[str, str] = {}
        self._cards: dict[tuple[str, str, int, int], ModelCard] = {}  # unloaded models', by file and version
        self._claims: dict[str, int] = {}  # requests awaiting each load
        self._starting: dict[str, int] = {}  # loads past _make_room, not yet loaded: their estimated bytes
        self._waiting = 0
        self._cancel = threading.Event()  # set at shutdown: loads in progress stop
        self._threads = ThreadPoolExecutor(max_workers=self.options.max_loaded + 2, thread_name_prefix="folio-models")
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
        model = await self._acquire(self._resolve(name))
        try:
            yield model.context
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
        return statuses

    async def card(self, name: str) -> ModelCard | None:
        source = self._resolve(name)
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
        model = await self._acquire(self._resolve(name))
        model.leases -= 1
        model.last_used = time.monotonic()

    async def unload(self, name: str) -> bool:
        source = self._resolve(name)
        model = self._loaded.get(source.name)
        if model is None:
            return False
        model.keep_alive = 0.0  # the reaper unloads it once its requests are done
        await self._reap_once()
        return True

    async def delete(self, name: str) -> None:
        source = self._resolve(name)
        if source.spec not in CATALOG:
            raise APIError(400, f"'{source.name}' is {source.spec}, not a model folio pulled: delete its files "
                           "yourself", param="model")  # fmt: skip
        await self.unload(source.name)  # its engine keeps the open file until its requests are done
        if not await asyncio.to_thread(catalog.remove, source.spec):
            raise APIError(404, f"model '{name}' not found: it is not pulled", param="model")

    async def load_adapter(self, name: str, path: str) -> None:
        raise APIError(400, "LoRA adapters are served by a server of one model, not yet by a server of several")

    async def unload_adapter(self, name: str) -> None:
        raise APIError(400, "LoRA adapters are served by a server of one model, not yet by a server of several")

    # -- loading ---------------------------------------------------------------------------------------
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
            raise model_not_found(name, list(available))
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
        """The server's flags for this model. A KV pool left to its default gets at most a share of the
        budget (half of it over --max-loaded-models), not the default share of free memory each: models
        loaded later would find that memory taken."""
        args = replace(self.base_args, model=source.spec)
        budget = self.options.memory_budget
        if budget is None or args.kv_cache_memory is not None or args.num_kv_blocks is not None:
            return args
        device = torch.device(args.device) if args.device else default_device()
        return replace(
            args, kv_cache_memory=min(default_kv_cache_memory(device), budget // (2 * self.options.max_loaded))
        )

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
            context = self.make_context(engine, engine.info, source.name)
            model = LoadedModel(source, engine, context, self.options.keep_alive, estimate)
            self._loaded[source.name] = model
            logger.info("loaded %s in %.1f s (engine in process %d)", source.name, time.perf_counter() - start,
                        engine.process.pid)  # fmt: skip
            return model
        finally:
            del self._loading[source.name]
            if started:
                self._starting.pop(source.name)

    def estimate_bytes(self, source: ModelSource, args: EngineArgs) -> int:
        """What a model will hold before it loads: its weights as stored (a pulled or local file; 0 for one
        still to download) and the KV cache its flags ask for (the engine's default share of free memory
        where none is given; a pool given in blocks counts once loaded)."""
        path = source.local_path()
        weights = 0
        if path is not None:
            files = [f for f in path.iterdir() if f.is_file()] if path.is_dir() else [path]
            weights = sum(f.stat().st_size for f in files)
        if args.num_kv_blocks is not None:
            return weights
        kv = parse_memory(args.kv_cache_memory)
        device = torch.device(args.device) if args.device else default_device()
        return weights + (kv if kv is not None else default_kv_cache_memory(device))

    def _start_engine(self, args: EngineArgs, name: str) -> ProcessEngine:
        return ProcessEngine(args, name, cancel=self._cancel)

    def _fits(self, estimate: int) -> bool:
        if len(self._loaded) + len(self._starting) >= self.options.max_loaded:
            return False
        budget = self.options.memory_budget
        used = sum(m.resident_bytes for m in self._loaded.values()) + sum(self._starting.values())
        return budget is None or used + estimate <= budget

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
                idle = [m for m in self._loaded.values() if self._evictable(m)]
                if idle:
                    await self._drop(min(idle, key=lambda m: m.last_used))
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

    async def _drop(self, model: LoadedModel) -> None:
        if self._loaded.get(model.name) is model:
            del self._loaded[model.name]
        reason = "its engine died" if not model.engine.is_alive else "idle"
        logger.info("unloading %s (%s)", model.name, reason)
        await asyncio.get_running_loop().run_in_executor(self._threads, model.engine.shutdown)

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
