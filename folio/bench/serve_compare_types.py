"""What `folio bench serve-compare` gives: each server's run and the report; kept apart from the runner so
the report writers (serve_compare_report.py) never import it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from folio.bench.serve_types import ServeReport

if TYPE_CHECKING:  # a field's annotation only
    from folio.bench.serve_compare import CompareConfig


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
