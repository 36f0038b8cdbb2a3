"""One set of tiny models of every architecture for all the split-model tests (saved once a session)."""

from __future__ import annotations

import pytest

from tests.tiny_models import NEW_ARCHITECTURE_KINDS, TINY_KINDS, make_tiny_model


@pytest.fixture(scope="session")
def tiny_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("split-tiny")
    return {kind: make_tiny_model(kind, root / kind) for kind in TINY_KINDS + NEW_ARCHITECTURE_KINDS}
