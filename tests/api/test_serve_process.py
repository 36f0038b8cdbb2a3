"""`folio serve` as a process a supervisor runs: it exits non-zero when its engine dies, exits 0 on a
SIGTERM that arrives during start-up, honours a fractional grace period, warns when it listens beyond
loopback without a key, and refuses an empty key."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.api.server_runner import MODEL, free_port, read_until

# Runs `folio serve` with an engine whose fourth step raises a BaseException, as a native panic would.
PANICKING_SERVE = """
import sys
from folio.engine.engine_core import EngineCore

class Panic(BaseException):
    pass

real_step, steps = EngineCore.step, []

def step(self):
    steps.append(1)
    if len(steps) > 3:
        raise Panic("injected")
    return real_step(self)

EngineCore.step = step
from folio.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _serve(*args: str, script: str | None = None, env: dict | None = None) -> subprocess.Popen:
    command = [sys.executable, "-c", script] if script else [sys.executable, "-m", "folio.cli"]
    return subprocess.Popen([*command, "serve", *args], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})  # fmt: skip


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _wait_for(condition, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def _stop(process: subprocess.Popen) -> str:
    if process.poll() is None:
        process.kill()
    return process.communicate()[1]


def test_serve_exits_non_zero_when_its_engine_dies(smollm2_gguf):
    port = free_port()
    process = _serve(MODEL, "--port", str(port), "--kv-cache-memory", "64MiB", script=PANICKING_SERVE)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for(lambda: process.poll() is None and _healthy(url), timeout=120)
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 50, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as response:
            lines = [line for line in response.iter_lines() if line]
        assert lines[-1] == "data: [DONE]" and "engine_dead" in lines[-2]
        assert process.wait(30) == 1
    finally:
        stderr = _stop(process)
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("folio: error: the engine thread died"), stderr


def test_sigterm_during_start_up_exits_0_without_a_traceback(smollm2_gguf):
    # NF4 quantization at load keeps the start-up busy for seconds after it says "loading".
    process = _serve(MODEL, "--port", str(free_port()), "--quantization", "nf4", "--kv-cache-memory", "64MiB")
    try:
        lines: list[str] = []
        read_until(process.stderr, "loading", lines)
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    finally:
        stderr = "".join(lines) + _stop(process)
    assert "SIGTERM before the server started" in stderr and "Traceback" not in stderr, stderr
    assert "serving" not in stderr


def test_a_fractional_grace_period_and_a_public_host_without_a_key(smollm2_gguf):
    port = free_port()
    process = _serve(MODEL, "--host", "0.0.0.0", "--port", str(port), "--grace-period", "0.5",
                     "--kv-cache-memory", "64MiB")  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    received = threading.Event()
    try:
        _wait_for(lambda: process.poll() is None and _healthy(url), timeout=120)

        def stream() -> None:
            body = {"model": MODEL, "prompt": "Hi", "max_tokens": 5000, "ignore_eos": True, "stream": True}
            try:
                with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
                    for _ in response.iter_lines():
                        received.set()
            except httpx.HTTPError:
                pass  # cut off when the grace period ends

        reader = threading.Thread(target=stream, daemon=True)
        reader.start()
        assert received.wait(30)
        process.send_signal(signal.SIGTERM)
        started = time.monotonic()
        assert process.wait(30) == 0
        assert time.monotonic() - started < 10  # the 5000-token stream did not get to finish
    finally:
        stderr = _stop(process)
    assert "without an API key" in stderr and "0.0.0.0" in stderr, stderr


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_an_empty_api_key_is_an_error(how):
    args = ["--api-key", ""] if how == "flag" else []
    process = _serve(MODEL, "--port", str(free_port()), *args, env={"FOLIO_API_KEY": ""})
    assert process.wait(60) == 1
    stderr = _stop(process)
    assert stderr.strip().splitlines() == [stderr.strip().splitlines()[-1]]
    assert "API key" in stderr and "empty" in stderr


def test_the_serving_line_comes_once_connections_are_accepted_and_names_the_bound_port(smollm2_gguf):
    # A client that starts `folio serve` and waits for its "serving" line may connect at once; with
    # --port 0 the line is the only place the port the system chose can be read from.
    process = _serve(MODEL, "--port", "0", "--kv-cache-memory", "64MiB")
    lines: list[str] = []
    try:
        url = read_until(process.stderr, "serving", lines).split(" at ")[1].split()[0].removesuffix("/v1")
        assert not url.endswith(":0")
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200  # no retry: refused would fail here
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    finally:
        stderr = "".join(lines) + _stop(process)
    assert "Traceback" not in stderr, stderr
