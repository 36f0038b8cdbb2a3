"""`folio serve`: load a model, start the engine thread, run uvicorn until SIGINT/SIGTERM.

On SIGTERM uvicorn stops accepting connections and lets in-flight requests finish for up to
`grace_period` seconds; then the engine thread stops and the process exits 0.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI

from folio.engine.async_engine import AsyncEngine
from folio.engine.llm import LLM
from folio.server.admission import Admission
from folio.server.app import create_app
from folio.server.context import ServerContext
from folio.server.metrics import ServerMetrics

logger = logging.getLogger("folio")


@dataclass
class ServerOptions:
    max_queue: int = 256  # requests waiting beyond max_num_seqs before 429
    api_key: str | None = None
    grace_period: float = 30.0  # seconds in-flight requests get after SIGTERM


@dataclass
class Server:
    app: FastAPI
    engine: AsyncEngine
    metrics: ServerMetrics


class _GracefulServer(uvicorn.Server):
    """uvicorn re-raises SIGTERM after its graceful shutdown, so the process would end with status 143;
    a shutdown that finished cleanly should exit 0."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, sig: int, frame: object) -> None:
        if not self.should_exit:
            logger.info("%s: finishing requests in flight, then stopping", signal.Signals(sig).name)
        self.handle_exit(sig, frame)  # type: ignore[arg-type]


def build_server(llm: LLM, model_name: str, options: ServerOptions | None = None) -> Server:
    options = options or ServerOptions()
    llm.engine.scheduler.gate.flush = False  # requests keep arriving: a static batch waits to be full
    metrics = ServerMetrics(llm.engine, model_name)
    engine = AsyncEngine(llm.engine, llm.tokenizer, frozenset(llm.model_config.eos_token_ids), observer=metrics)
    ctx = ServerContext(
        engine=engine,
        tokenizer=llm.tokenizer,
        model_name=model_name,
        vocab_size=llm.model_config.vocab_size,
        admission=Admission(llm.engine.scheduler_config.max_num_seqs, options.max_queue),
    )
    return Server(create_app(ctx, metrics, options.api_key), engine, metrics)


def serve(llm: LLM, model_name: str, host: str, port: int, options: ServerOptions | None = None) -> None:
    options = options or ServerOptions()
    server = build_server(llm, model_name, options)
    config = uvicorn.Config(
        server.app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=int(options.grace_period)
    )
    logger.info(
        "serving %s (%s, KV cache %d tokens, context %d) at http://%s:%d/v1%s",
        model_name,
        str(llm.dtype).removeprefix("torch."),
        llm.engine.kv.capacity_tokens,
        llm.engine.max_model_len,
        host,
        port,
        " (API key required)" if options.api_key else "",
    )
    try:
        _GracefulServer(config).run()
    finally:
        server.engine.shutdown()
    logger.info("server stopped")
