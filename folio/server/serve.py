"""`folio serve`: load a model, start the engine (a thread here, or a process of its own with
`--engine-process`), run uvicorn until SIGINT/SIGTERM.

On SIGTERM uvicorn stops accepting connections and lets in-flight requests finish for up to
`grace_period` seconds; then the engine thread stops and the process exits 0. A SIGTERM that arrives
while the model is still loading stops the start-up cleanly (`sigterm_stops_startup`). If the engine
thread dies, /health answers 503, the server shuts down and `serve` raises `EngineDiedError`, so the
process exits non-zero and a supervisor restarts it.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from folio.engine.engine_core import EngineCore
from folio.engine_args import EngineArgs
from folio.server.adapters import AdapterTable, LoRAModule
from folio.server.admission import Admission
from folio.server.app import create_app
from folio.server.context import ChatOptions, ServerContext
from folio.server.engine_client.process import EngineMetricsCollector, EngineProcessDied, ProcessEngine
from folio.server.engine_client.protocol import EngineClient
from folio.server.engine_client.thread import AsyncEngine
from folio.server.engine_client.wire import EngineInfo
from folio.server.limits import RequestLimits
from folio.server.metrics import MergedEngineMetrics, ServerMetrics, track_admission
from folio.server.model_budget import ManagerOptions
from folio.server.model_manager import ModelManager
from folio.server.model_sources import ModelSources
from folio.server.served_models import OneModel

logger = logging.getLogger("folio")


class EngineDiedError(RuntimeError):
    """The engine thread died while serving; the server stopped."""


class StartupInterrupted(BaseException):
    """SIGTERM arrived before the server was serving. A BaseException, as KeyboardInterrupt is, so that
    code which falls back on any Exception (a kernel that fails to build) does not swallow it."""


@dataclass
class ServerOptions:
    max_queue: int = 256  # requests waiting beyond max_num_seqs before 429
    api_key: str | None = None
    grace_period: float = 30.0  # seconds in-flight requests get after SIGTERM
    limits: RequestLimits = field(default_factory=RequestLimits)
    chat: ChatOptions = field(default_factory=ChatOptions)  # tool-call and reasoning parsers
    lora_modules: list[LoRAModule] = field(default_factory=list)  # adapters registered at start-up
    runtime_lora: bool = False  # whether /v1/load_lora_adapter and /v1/unload_lora_adapter may change them
    ui: bool = True  # the playground at / and the dashboard at /dashboard (--no-ui: off)

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("the API key is empty; pass a real key, or none to serve without authentication")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if not self.grace_period >= 0:  # NaN fails too
            raise ValueError(f"the grace period must be >= 0 seconds, got {self.grace_period}")


@dataclass
class Server:
    app: FastAPI
    context: ServerContext
    registry: CollectorRegistry  # what /metrics serves
    info: EngineInfo

    @property
    def engine(self) -> AsyncEngine | ProcessEngine:
        engine = self.context.engine
        assert isinstance(engine, AsyncEngine | ProcessEngine)
        return engine


class _GracefulServer(uvicorn.Server):
    """uvicorn re-raises SIGTERM after its graceful shutdown, so the process would end with status 143;
    a shutdown that finished cleanly should exit 0."""

    def capture_signals(self) -> contextlib.AbstractContextManager[None]:
        return _handling(self._on_signal, signal.SIGINT, signal.SIGTERM)

    def _on_signal(self, sig: int, frame: object) -> None:
        if not self.should_exit:
            logger.info("%s: finishing requests in flight, then stopping", signal.Signals(sig).name)
        self.handle_exit(sig, frame)  # type: ignore[arg-type]


def build_server(
    core: EngineCore,
    model_name: str,
    options: ServerOptions | None = None,
    on_engine_death: Callable[[BaseException], None] | None = None,
) -> Server:
    """The server over an engine loop on a thread of this process (`core` from EngineCore.from_engine_args)."""
    metrics = ServerMetrics(core, model_name)
    eos = frozenset(core.model_config.eos_token_ids)
    engine = AsyncEngine(core, core.tokenizer, eos, observer=metrics, on_death=on_engine_death)
    return _assemble(engine, EngineInfo.of(core, model_name), model_name, options, metrics.registry)


def build_process_server(engine: ProcessEngine, model_name: str, options: ServerOptions | None = None) -> Server:
    """The server over an engine in a process of its own; /metrics asks it for its metrics."""
    registry = CollectorRegistry()
    registry.register(EngineMetricsCollector(engine.metrics_text))
    return _assemble(engine, engine.info, model_name, options, registry)


def make_context(engine: EngineClient, info: EngineInfo, model_name: str, options: ServerOptions) -> ServerContext:
    """One model's context for the routes: its engine, tokenizer and admission, and the server's limits."""
    assert info.tokenizer is not None, "an engine's info with its tokenizer (ProcessEngine fills it in)"
    return ServerContext(
        engine=engine,
        tokenizer=info.tokenizer,
        model_name=model_name,
        vocab_size=info.vocab_size,
        hidden_size=info.hidden_size,
        admission=Admission(info.max_num_seqs, options.max_queue),
        limits=options.limits,
        chat=options.chat,
        model_card=info.model_card,
    )


def _assemble(
    engine: EngineClient, info: EngineInfo, model_name: str, options: ServerOptions | None, registry: CollectorRegistry
) -> Server:
    options = options or ServerOptions()
    ctx = make_context(engine, info, model_name, options)
    track_admission(registry, model_name, ctx.admission)
    models = OneModel(ctx, AdapterTable(options.lora_modules, options.runtime_lora))
    app = create_app(models, options.limits, registry, options.api_key, options.ui)
    return Server(app, ctx, registry, info)


def where(host: str, port: int, options: ServerOptions) -> str:
    """The serving line's addresses: the API's, the playground's, and whether a key is needed."""
    base = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    notes = ["API key required"] if options.api_key else []
    if options.ui:
        notes.append(f"playground at {base}/")
    return f"{base}/v1" + (f" ({'; '.join(notes)})" if notes else "")


def is_loopback(host: str) -> bool:
    """Whether every address `host` names is a loopback one (an unresolvable name counts as not)."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return all(a.startswith("127.") or a == "::1" for a in addresses)


def warn_if_open(host: str, port: int, api_key: str | None) -> None:
    if api_key is None and not is_loopback(host):
        logger.warning(
            "WARNING: serving on %s without an API key: anyone who can reach port %d can use this model. "
            "Pass --api-key (or set FOLIO_API_KEY), or bind 127.0.0.1.",
            host,
            port,
        )


class PortUnavailable(OSError):
    """The address to serve on cannot be bound (taken, or not this host's)."""


def bind_address(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, not yet listening: a taken port fails before the model loads, and
    connections are refused (not left hanging) until the server listens."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: restarts reuse TIME_WAIT
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise PortUnavailable(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    return sock


def serve(
    args: EngineArgs, host: str, port: int, options: ServerOptions | None = None, engine_process: bool = False
) -> None:
    """Load the model `args` describe and serve it under its own name until SIGINT/SIGTERM; with
    `engine_process`, the engine loads and runs in a process of its own."""
    options = options or ServerOptions()
    warn_if_open(host, port, options.api_key)
    with contextlib.closing(bind_address(host, port)) as sock:
        _serve_on(sock, args, host, options, engine_process)


def _serve_on(sock: socket.socket, args: EngineArgs, host: str, options: ServerOptions, engine_process: bool) -> None:
    port = sock.getsockname()[1]
    model_name = args.model
    http: list[uvicorn.Server] = []  # filled below; the engine may die before uvicorn exists

    def stop_on_engine_death(_: BaseException) -> None:
        for running in http:
            running.should_exit = True

    if engine_process:
        engine = ProcessEngine(args, model_name, stop_on_engine_death)
        try:
            for adapter in options.lora_modules:
                engine.change_adapter(add=adapter.request)
        except BaseException:
            engine.shutdown()
            raise
        server = build_process_server(engine, model_name, options)
    else:
        core = EngineCore.from_engine_args(args)
        for adapter in options.lora_modules:
            core.add_lora(adapter.request)
        server = build_server(core, model_name, options, stop_on_engine_death)
    config = uvicorn.Config(
        server.app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=options.grace_period
    )  # type: ignore[arg-type]  # uvicorn hints an int; it passes the value to asyncio.wait_for
    info = server.info
    sock.listen(config.backlog)  # before "serving" is logged: a client that reads the line may connect at once
    logger.info(
        "serving %s (%s, KV cache %d tokens, context %d%s) at %s",
        model_name,
        info.dtype,
        info.kv_capacity_tokens,
        info.max_model_len,
        f", engine in process {server.engine.process.pid}" if isinstance(server.engine, ProcessEngine) else "",
        where(host, port, options),
    )
    http.append(_GracefulServer(config))
    try:
        if server.engine.is_alive:
            http[0].run(sockets=[sock])
    finally:
        server.engine.shutdown()  # a split model's ranks too
    dead = server.engine.dead
    if isinstance(dead, EngineProcessDied):
        raise EngineDiedError(f"the engine process died: {dead}")
    if dead is not None:
        raise EngineDiedError(f"the engine thread died ({type(dead).__name__}); see the log above")
    logger.info("server stopped")


def serve_models(
    sources: ModelSources, base_args: EngineArgs, host: str, port: int, options: ServerOptions | None = None,
    manager_options: ManagerOptions | None = None,
) -> None:  # fmt: skip
    """Serve the models `sources` names, each loaded (with `base_args`' flags) when a request first names
    it, in an engine process of its own, until SIGINT/SIGTERM."""
    options = options or ServerOptions()
    warn_if_open(host, port, options.api_key)
    with contextlib.closing(bind_address(host, port)) as sock:
        adapters = AdapterTable(options.lora_modules, options.runtime_lora)
        manager = ModelManager(sources, base_args, lambda e, i, n: make_context(e, i, n, options), manager_options,
                               adapters)  # fmt: skip
        registry = CollectorRegistry()
        registry.register(MergedEngineMetrics(manager.metrics_texts, manager.admissions))
        app = create_app(manager, options.limits, registry, options.api_key, options.ui)
        config = uvicorn.Config(app, host=host, port=port, log_level="warning",
                                timeout_graceful_shutdown=options.grace_period)  # type: ignore[arg-type]  # fmt: skip
        sock.listen(config.backlog)
        manager.starter.start_spare()  # the first load's engine process, imports done before it is asked for
        names = list(sources.available())
        logger.info("serving %d models (%s%s), loaded on first use, at most %d at once, at %s",
                    len(names), ", ".join(names[:8]), ", ..." if len(names) > 8 else "", manager.options.max_loaded,
                    where(host, port, options))  # fmt: skip
        if not names:
            logger.warning("no model to serve yet: pull one (folio pull NAME) or name models on the command line")
        try:
            _GracefulServer(config).run(sockets=[sock])
        finally:
            manager.shutdown()
    logger.info("server stopped")


@contextlib.contextmanager
def _handling(handler: Callable[[int, object], None], *signals: signal.Signals) -> Iterator[None]:
    """`handler` for `signals` while the block runs (only the main thread can set handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def sigterm_stops_startup() -> contextlib.AbstractContextManager[None]:
    """Until uvicorn installs its own handlers, SIGTERM raises StartupInterrupted in the main thread, so a
    start-up (model load, kernel builds) stops through its finally blocks instead of dying mid-write."""

    def interrupt(sig: int, frame: object) -> None:
        raise StartupInterrupted()

    return _handling(interrupt, signal.SIGTERM)
