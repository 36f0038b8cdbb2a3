"""Runs a real uvicorn server in a background thread on an ephemeral 127.0.0.1 port."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from folio import LLM
from folio.server.serve import Server, ServerOptions, build_server

MODEL = "smollm2-135m"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class ServeProcess:
    """`folio serve ARGS --port <free port>` as a process of its own, its output in a temporary log."""

    def __init__(self, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="folio-serve-", suffix=".log")  # noqa: SIM115
        command = [sys.executable, "-m", "folio.cli", "serve", *args, "--port", str(self.port)]
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)

    def output(self) -> str:
        return open(self.log.name).read()

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.output()[-3000:]
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"not serving:\n{self.output()[-3000:]}")


def read_until(stream: Iterable[str], word: str, lines: list[str]) -> str:
    """Read a server process's output into `lines` up to the first line holding `word`; that line ("" if the
    output ended first). `lines` keeps what was read for the test's failure message."""
    for line in stream:
        lines.append(line)
        if word in line:
            return line
    return ""


@contextmanager
def running_server(llm: LLM, model_name: str, options: ServerOptions | None = None) -> Iterator[tuple[str, Server]]:
    server = build_server(llm.engine, model_name, options)
    with serving(server) as url:
        yield url, server


@contextmanager
def serving(server: Server) -> Iterator[str]:
    """Serve `server`'s app until the block ends, then stop it and its engine; yields its base URL."""
    port = free_port()
    http = uvicorn.Server(uvicorn.Config(server.app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not http.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        http.should_exit = True
        thread.join(timeout=10)
        server.engine.shutdown()


def aborted_requests(url: str) -> float:
    """The server's count of requests that ended aborted (a client hung up), from /metrics."""
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.name == "folio:request_success_total" and sample.labels["finished_reason"] == "abort":
                return sample.value
    return 0.0
