"""Run llama.cpp's `llama-server` for a benchmark: its command line, start, wait until healthy, stop, and
`running_llama_server`, a context manager that does all of it on a free port."""

from __future__ import annotations

import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

from folio_tools.bench.peers.llama_cpp_build import LlamaCppBinaries


@lru_cache(maxsize=8)
def _help_text(server: Path) -> str:
    out = subprocess.run([str(server), "--help"], capture_output=True, text=True, errors="replace", timeout=60)
    return out.stdout + out.stderr


def server_command(
    binaries: LlamaCppBinaries,
    model_path: Path,
    port: int,
    *,
    ctx_size: int,
    parallel: int,
    threads: int = 2,
    host: str = "127.0.0.1",
    cont_batching_flag: bool = True,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The llama-server command line. `ctx_size` is the KV cache's total size in tokens: llama-server
    splits it evenly across the `parallel` slots, so each request gets at most ctx_size // parallel
    tokens (prompt plus output) unless `--kv-unified` is among `extra_args`."""
    if parallel < 1 or ctx_size < parallel:
        raise ValueError(f"need parallel >= 1 and ctx_size >= parallel, got {parallel=} {ctx_size=}")
    options = {
        "--model": model_path,
        "--host": host,
        "--port": port,
        "--ctx-size": ctx_size,
        "--parallel": parallel,
        "--threads": threads,
        "--threads-batch": threads,  # prompt processing; defaults to --threads, but be explicit
    }
    cmd = [str(binaries.server), *(str(item) for pair in options.items() for item in pair)]
    if cont_batching_flag:
        cmd.append("--cont-batching")  # the default since 2024, but say so in case that ever changes
    return [*cmd, *extra_args]


def start_llama_server(
    binaries: LlamaCppBinaries,
    model_path: Path,
    port: int,
    *,
    ctx_size: int,
    parallel: int,
    threads: int = 2,
    host: str = "127.0.0.1",
    extra_args: Sequence[str] = (),
    log_path: Path | None = None,
) -> subprocess.Popen[bytes]:
    """Start llama-server in the background. Its output goes to `log_path` (a pipe nobody reads would
    fill up and stall the server), or to our own stdout/stderr when None."""
    cmd = server_command(
        binaries,
        model_path,
        port,
        ctx_size=ctx_size,
        parallel=parallel,
        threads=threads,
        host=host,
        cont_batching_flag="--cont-batching" in _help_text(binaries.server),
        extra_args=extra_args,
    )
    if log_path is None:
        return subprocess.Popen(cmd)
    with log_path.open("ab") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def _tail(path: Path | None, lines: int = 20) -> str:
    if path is None or not path.is_file():
        return ""
    return "".join(path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)[-lines:])


def poll_health(base_url: str, process: subprocess.Popen[bytes], timeout: float) -> str | None:
    """Poll GET /health until it answers 200 (llama-server says 503 while it loads the model).
    None once healthy; otherwise why not: "exited" (the process died first) or "timeout"."""
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            return "exited"
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=2) as response:
                if response.status == 200:
                    return None
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass  # not listening yet, or 503 while loading
        if time.monotonic() > deadline:
            return "timeout"
        time.sleep(0.2)


def wait_for_health(
    base_url: str, process: subprocess.Popen[bytes], *, timeout: float = 120.0, log_path: Path | None = None
) -> None:
    """Block until llama-server is healthy; raise with the tail of its log if it is not."""
    failure = poll_health(base_url, process, timeout)
    if failure == "exited":
        raise RuntimeError(f"llama-server exited with code {process.returncode} before it was ready\n{_tail(log_path)}")
    if failure == "timeout":
        raise TimeoutError(f"llama-server at {base_url} not healthy after {timeout:.0f}s\n{_tail(log_path)}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def stop_process(process: subprocess.Popen[bytes], grace: float = 10.0) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextmanager
def running_llama_server(
    binaries: LlamaCppBinaries,
    model_path: Path,
    port: int | None = None,
    *,
    ctx_size: int,
    parallel: int,
    threads: int = 2,
    extra_args: Sequence[str] = (),
    timeout: float = 120.0,
    log_path: Path | None = None,
) -> Iterator[str]:
    """A ready llama-server on 127.0.0.1 (a free port unless given); yields its base URL, e.g.
    'http://127.0.0.1:41234', for the OpenAI routes under /v1. The log goes to `log_path`, else to a
    temporary file that is removed afterwards."""
    port = port or free_port()
    with tempfile.TemporaryDirectory(prefix="folio-llama-server-") as tmp:
        log = log_path or Path(tmp) / "server.log"
        process = start_llama_server(
            binaries,
            model_path,
            port,
            ctx_size=ctx_size,
            parallel=parallel,
            threads=threads,
            extra_args=extra_args,
            log_path=log,
        )
        try:
            base_url = f"http://127.0.0.1:{port}"
            wait_for_health(base_url, process, timeout=timeout, log_path=log)
            yield base_url
        finally:
            stop_process(process)
