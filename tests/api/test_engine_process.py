"""`folio serve --engine-process`: the engine loads and runs in a process of its own.

Served through it, answers equal those of the engine on a thread (greedy with logprobs, seeded samples
forked from one prompt); hang-ups abort within a step and give back every block; /metrics serves the
engine's metrics with the server's own admission count; a killed engine fails its clients at once and
makes /health 503; a model that cannot load is one clear error; and no engine outlives its server,
whether the server stops or is killed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from folio.engine_args import EngineArgs
from folio.server.engine_client.process import ProcessEngine
from folio.server.serve import build_process_server
from tests.api.server_runner import MODEL, aborted_requests, free_port, read_until, serving
from tests.tiny_models import make_tiny_model


def _wait_for(condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def _engine_metrics(url: str) -> dict[str, float]:
    """Unlabelled-by-reason samples of /metrics, by name (the model_name label dropped)."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for sample in family.samples:
            if set(sample.labels) == {"model_name"}:
                values[sample.name] = sample.value
    return values


@pytest.fixture(scope="module")
def process_served(smollm2_gguf):
    engine = ProcessEngine(EngineArgs(model=str(smollm2_gguf), kv_cache_memory="64MiB"), MODEL)
    server = build_process_server(engine, MODEL)
    with serving(server) as url:
        yield url, server
    assert not engine.process.is_alive()


def test_answers_equal_the_engine_on_a_thread(process_served, client):
    url, _ = process_served
    apart = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    greedy = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0, "logprobs": 2}
    here, there = client.completions.create(**greedy), apart.completions.create(**greedy)
    assert there.choices[0].text == here.choices[0].text
    assert there.choices[0].logprobs.tokens == here.choices[0].logprobs.tokens
    assert there.choices[0].logprobs.token_logprobs == pytest.approx(here.choices[0].logprobs.token_logprobs, abs=1e-5)
    seeded = {"model": MODEL, "messages": [{"role": "user", "content": "Name a fruit."}], "max_tokens": 12,
              "n": 3, "seed": 11, "temperature": 1.0, "stream": True}  # fmt: skip

    def texts(openai_client: openai.OpenAI) -> list[str]:
        parts = ["", "", ""]
        for chunk in openai_client.chat.completions.create(**seeded):
            for choice in chunk.choices:
                parts[choice.index] += choice.delta.content or ""
        return parts

    assert texts(apart) == texts(client)


def test_a_client_that_hangs_up_is_aborted_and_its_blocks_come_back(process_served):
    url, server = process_served
    before = aborted_requests(url)
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 3000, "ignore_eos": True, "n": 2,
            "temperature": 1.0}  # fmt: skip
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=body, timeout=1.0)
    _wait_for(lambda: aborted_requests(url) == before + 2)
    metrics = _engine_metrics(url)
    assert metrics["folio:num_requests_running"] == 0 and metrics["folio:kv_cache_usage_ratio"] == 0
    _wait_for(lambda: server.context.admission.in_flight == 0)


def test_metrics_are_the_engines_with_the_servers_admission(process_served):
    url, _ = process_served
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "ignore_eos": True}
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
    text = httpx.get(f"{url}/metrics", timeout=30).text
    assert text.count("# TYPE folio:num_requests_admitted gauge") == 1
    metrics = _engine_metrics(url)
    assert metrics["folio:generation_tokens_total"] >= 3 and metrics["folio:time_to_first_token_seconds_count"] >= 1
    assert metrics["folio:num_requests_admitted"] == 0


def test_bad_requests_are_answered_and_serving_goes_on(process_served):
    url, _ = process_served
    too_long = {"model": MODEL, "prompt": [1] * 100_000, "max_tokens": 3}
    refused = httpx.post(f"{url}/v1/completions", json=too_long, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
    bad = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "temperature": -1}, timeout=60)
    assert bad.status_code == 400
    ok = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_a_killed_engine_fails_its_clients_at_once_and_reports_unhealthy(tmp_path):
    deaths: list[BaseException] = []
    engine = ProcessEngine(EngineArgs(model=str(make_tiny_model("llama", tmp_path / "tiny")),
                                      kv_cache_memory="16MiB"), "tiny", on_death=deaths.append)  # fmt: skip
    with serving(build_process_server(engine, "tiny")) as url:
        lines: list[str] = []
        body = {"model": "tiny", "prompt": "t1 t2 t3", "max_tokens": 100_000, "ignore_eos": True, "stream": True}

        def read() -> None:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
                lines.extend(line for line in response.iter_lines() if line)

        reader = threading.Thread(target=read)
        reader.start()
        _wait_for(lambda: len(lines) >= 3)  # streaming
        os.kill(engine.process.pid, signal.SIGKILL)
        started = time.monotonic()
        reader.join(10)
        assert time.monotonic() - started < 5
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2].removeprefix("data: "))["error"]["code"] == "engine_dead"
        assert len(deaths) == 1 and "exited" in str(deaths[0])
        assert httpx.get(f"{url}/health").status_code == 503
        refused = httpx.post(f"{url}/v1/completions", json={**body, "stream": False})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_dead"


def test_a_model_that_cannot_load_is_one_clear_error_and_leaves_nothing_running(tmp_path):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    sockets = set(_socket_dirs())
    with pytest.raises(ValueError, match="no-such-model"):
        ProcessEngine(EngineArgs(model=str(tmp_path / "no-such-model.gguf")), "x")
    _wait_for(lambda: {p.pid for p in psutil.Process().children(recursive=True)
                       if p.status() != psutil.STATUS_ZOMBIE} <= before | _trackers())  # fmt: skip
    assert set(_socket_dirs()) <= sockets


def _socket_dirs() -> list[Path]:
    return list(Path(tempfile.gettempdir()).glob("folio-engine-*"))


def _trackers() -> set[int]:
    """multiprocessing's resource tracker: one per parent process, started with the first spawn."""
    return {p.pid for p in psutil.Process().children() if "resource_tracker" in " ".join(p.cmdline())}


ORPHANED = """
import sys, time
from folio.engine_args import EngineArgs
from folio.server.engine_client.process import ProcessEngine
engine = ProcessEngine(EngineArgs(model=sys.argv[1], kv_cache_memory="16MiB"), "tiny")
print(engine.process.pid, flush=True)
time.sleep(600)
"""


def test_the_engine_stops_when_its_server_is_killed(tmp_path):
    model = make_tiny_model("llama", tmp_path / "tiny")
    server = subprocess.Popen([sys.executable, "-c", ORPHANED, str(model)], stdout=subprocess.PIPE, text=True)
    try:
        engine_pid = int(server.stdout.readline())
        server.kill()
        server.wait(10)
        _wait_for(lambda: not psutil.pid_exists(engine_pid)
                  or psutil.Process(engine_pid).status() == psutil.STATUS_ZOMBIE, timeout=15)  # fmt: skip
    finally:
        if server.poll() is None:
            server.kill()


def test_folio_serve_engine_process_stops_cleanly_on_sigterm(smollm2_gguf):
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "folio.cli", "serve", MODEL, "--port", str(port),
                                "--kv-cache-memory", "64MiB", "--engine-process"], stderr=subprocess.PIPE,
                               text=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    lines: list[str] = []
    try:
        serving_line = read_until(process.stderr, "serving", lines)
        engine_pid = int(serving_line.split("engine in process ")[1].split(")")[0])
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 4, "ignore_eos": True}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["usage"]["completion_tokens"] == 4
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
        assert not psutil.pid_exists(engine_pid) or psutil.Process(engine_pid).status() == psutil.STATUS_ZOMBIE
    finally:
        if process.poll() is None:
            process.kill()
        stderr = "".join(lines) + process.communicate()[1]
    assert "Traceback" not in stderr and "server stopped" in stderr, stderr
