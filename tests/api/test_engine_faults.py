"""Engine faults as clients see them: a request that fails inside the engine ends with a 500, or, once
streaming, with an error event followed by `[DONE]`, while the requests beside it finish; a dead engine
makes every waiting client fail at once, /health answer 503 and new requests 503."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from folio import LLM
from tests.api.server_runner import running_server
from tests.faults import MARK, fail_marked_rows_in_the_sampler
from tests.tiny_models import make_tiny_model

STREAM = {"prompt": "Tell me a story.", "max_tokens": 40, "ignore_eos": True, "stream": True}


class Panic(BaseException):
    """Stands in for a native panic (PyO3's PanicException derives from BaseException)."""


@pytest.fixture
def faulty_row(monkeypatch):
    fail_marked_rows_in_the_sampler(monkeypatch)


def _wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def _events(url: str, body: dict, sink: list[str]) -> None:
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        sink.extend(line for line in response.iter_lines() if line)


def test_a_failed_stream_ends_with_an_error_event_and_done_while_its_neighbour_finishes(served, faulty_row):
    url, server = served
    model = server.context.model_name
    neighbour: list[str] = []
    reader = threading.Thread(target=_events, args=(url, {**STREAM, "model": model}, neighbour))
    reader.start()
    victim: list[str] = []
    _events(url, {**STREAM, "model": model, "top_k": MARK, "temperature": 1.0}, victim)
    reader.join(60)
    assert victim[-1] == "data: [DONE]"
    error = json.loads(victim[-2].removeprefix("data: "))["error"]
    assert error["type"] == "server_error" and error["code"] == "request_failed"
    assert neighbour[-1] == "data: [DONE]" and '"finish_reason": "length"' in neighbour[-2]
    _wait_for(lambda: server.context.admission.in_flight == 0)  # released as the response ends


def test_a_failed_request_is_a_500_in_the_error_format(served, faulty_row):
    url, server = served
    body = {"model": server.context.model_name, "prompt": "Hi", "max_tokens": 5, "top_k": MARK, "temperature": 1.0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 500
    assert response.json()["error"]["code"] == "request_failed"
    ok = httpx.post(f"{url}/v1/completions", json={**body, "top_k": 5}, timeout=60)
    assert ok.status_code == 200


def test_a_dead_engine_fails_waiting_clients_at_once_and_reports_unhealthy(tmp_path):
    llm = LLM(make_tiny_model("llama", tmp_path / "tiny"), kv_cache_memory="16MiB")
    with running_server(llm, "tiny") as (url, server):
        lines: list[str] = []
        body = {"model": "tiny", "prompt": "t1 t2 t3", "max_tokens": 100_000, "ignore_eos": True, "stream": True}
        reader = threading.Thread(target=_events, args=(url, body, lines))
        reader.start()
        deadline = time.monotonic() + 30
        while len(lines) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.01)

        def panic():
            raise Panic("injected")

        llm.engine.step = panic
        started = time.monotonic()
        reader.join(10)
        assert time.monotonic() - started < 5
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2].removeprefix("data: "))["error"]["code"] == "engine_dead"
        assert httpx.get(f"{url}/health").status_code == 503
        refused = httpx.post(f"{url}/v1/completions", json={**body, "stream": False})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_dead"
        _wait_for(lambda: server.context.admission.in_flight == 0)


def _lines(url: str, path: str, body: dict) -> list[str]:
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=60) as response:
        assert response.status_code == 200
        return [line for line in response.iter_lines() if line]


def test_other_apis_end_a_failed_stream_in_their_own_format(served, faulty_row):
    url, server = served
    model = server.context.model_name
    chat = {"model": model, "messages": [{"role": "user", "content": "Tell me a story."}]}
    ollama_lines = _lines(url, "/api/chat", {**chat, "options": {"top_k": MARK, "num_predict": 20}})
    last = json.loads(ollama_lines[-1])  # Ollama's error line, which its client raises
    assert list(last) == ["error"] and "failed inside the engine" in last["error"]
    anthropic_lines = _lines(url, "/v1/messages", {**chat, "max_tokens": 20, "top_k": MARK, "stream": True})
    assert anthropic_lines[-2] == "event: error"
    error = json.loads(anthropic_lines[-1].removeprefix("data: "))
    assert error["type"] == "error" and error["error"]["type"] == "api_error"
    whole = httpx.post(f"{url}/v1/messages", json={**chat, "max_tokens": 20, "top_k": MARK}, timeout=60)
    assert whole.status_code == 500 and whole.json()["error"]["type"] == "api_error"
    whole = httpx.post(f"{url}/api/chat", json={**chat, "stream": False, "options": {"top_k": MARK}}, timeout=60)
    assert whole.status_code == 500 and "failed inside the engine" in whole.json()["error"]
    _wait_for(lambda: server.context.admission.in_flight == 0)
