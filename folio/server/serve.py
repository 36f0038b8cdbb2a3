"""`folio serve`: load a model, start the engine thread, run uvicorn."""

from __future__ import annotations

import logging

import uvicorn

from folio.engine.async_engine import AsyncEngine
from folio.engine.llm import LLM
from folio.server.app import create_app

logger = logging.getLogger("folio")


def build_server_app(llm: LLM, model_name: str):
    engine = AsyncEngine(llm.engine, frozenset(llm.model_config.eos_token_ids))
    return create_app(engine, llm.tokenizer, model_name), engine


def serve(llm: LLM, model_name: str, host: str, port: int) -> None:
    app, engine = build_server_app(llm, model_name)
    logger.info(
        "serving %s (%s, KV capacity %d tokens) at http://%s:%d/v1",
        model_name,
        llm.dtype,
        llm.engine.kv.capacity_tokens,
        host,
        port,
    )
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning")
    finally:
        engine.shutdown()
