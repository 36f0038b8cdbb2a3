"""A `folio serve` process for the robustness benchmarks: started on a free port with the given flags,
ready when /health answers, stopped (SIGTERM, then SIGKILL) however the run ends. Its pid is exposed so
that a benchmark can watch its resident memory."""

from __future__ import annotations

import shlex
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from folio_tools.bench.peers.llama_cpp_server import free_port, stop_process
from folio_tools.bench.serve_compare.command import STOP_GRACE_S, start_process, wait_until_ready
from folio_tools.bench.serve_compare.peers import STARTUP_TIMEOUT_S

T = TypeVar("T")


@dataclass(frozen=True)
class RunningServer:
    base_url: str
    pid: int
    command: str


@contextmanager
def folio_server(model: str, flags: list[str], log_path: Path) -> Iterator[RunningServer]:
    port = free_port()
    argv = [sys.executable, "-m", "folio.cli", "serve", model, "--host", "127.0.0.1", "--port", str(port), *flags]
    process = start_process(argv, log_path)
    try:
        base_url = f"http://127.0.0.1:{port}"
        wait_until_ready("folio", base_url, process, STARTUP_TIMEOUT_S, log_path)
        yield RunningServer(base_url, process.pid, shlex.join(argv))
    finally:
        stop_process(process, grace=STOP_GRACE_S)


def against_server(
    model: str, flags: list[str], base_url: str | None, measure: Callable[[str], T]
) -> tuple[T, dict[str, Any]]:
    """`measure(url)` on the server already running at `base_url`, or on a `folio serve` started for it
    (and stopped after); with what it ran against, for the result's `server` field."""
    if base_url is not None:
        return measure(base_url.rstrip("/")), {"base_url": base_url}
    with tempfile.TemporaryDirectory() as tmp, folio_server(model, flags, Path(tmp) / "server.log") as running:
        return measure(running.base_url), {"command": running.command}


def resident_mib(pid: int) -> float | None:
    """The process's resident memory (VmRSS) in MiB, or None where /proc cannot tell."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
