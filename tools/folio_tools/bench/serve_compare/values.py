"""What `folio bench serve-compare` is given and gives: llama-server's options, how to start each server,
each server's run and the report; kept apart from the runner so the report writers
(serve_compare_report.py) never import it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from folio_tools.bench.serve.client import check_extra_body
from folio_tools.bench.serve.values import ServeReport

if TYPE_CHECKING:  # a field's annotation only
    from folio_tools.bench.serve_compare.command import CompareConfig


@dataclass
class ServerRun:
    name: str
    command: str  # the exact command line the server was started with
    info: dict[str, Any]
    report: ServeReport


@dataclass
class CompareReport:
    command: str
    date_utc: str
    config: CompareConfig
    machine: dict[str, Any]
    runs: list[ServerRun]  # folio first, then the peer


@dataclass(frozen=True)
class LlamaOptions:
    parallel: int = 16  # slots
    ctx_size: int | None = None  # total KV tokens over all slots; None: from the workload
    threads: int = 2
    extra_body: dict[str, Any] = field(default_factory=lambda: {"cache_prompt": False})
    version: str | None = None  # of llama-cpp-python; None: the installed build

    def __post_init__(self) -> None:
        if self.parallel < 1:
            raise ValueError(f"--llama-parallel must be at least 1, got {self.parallel}")
        if self.threads < 1:
            raise ValueError(f"--llama-threads must be at least 1, got {self.threads}")
        if self.ctx_size is not None and self.ctx_size < self.parallel:
            raise ValueError(f"--llama-ctx-size {self.ctx_size} leaves less than one token to each of the slots")
        check_extra_body(self.extra_body)


@dataclass(frozen=True)
class ServerSpec:
    name: str
    argv: Callable[[int], list[str]]  # the command line for a port, which is picked just before the start
    extra_body: dict[str, Any] = field(default_factory=dict)  # merged into every request to this server
    info: dict[str, Any] = field(default_factory=dict)  # versions, slots, context size: kept in the report
    probe_request: bool = True  # False for a static-batching server, which would hold the lone probe
    metrics_lag_s: float = 0.0  # how far its /metrics lag behind its requests (ServeConfig.metrics_lag_s)


class ServerError(RuntimeError):
    """A server failed to start or died during its run; the message names its log, which is kept."""
