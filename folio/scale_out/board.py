"""Where replicas post what they report (liveness, load, their Prometheus metrics), for the ingress.

A Ray Serve handle sends a call to one replica, never to all, so each replica posts a `ReplicaReport`
every `REPORT_PERIOD_S` to one small named actor, and the ingress reads the fresh ones: `/health`
(some replica is alive) and `/metrics` (every replica's series, labelled by replica) answer from the
last read. A replica that stops posting drops out after `STALE_AFTER_S`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import ray

REPORT_PERIOD_S = 1.0
STALE_AFTER_S = 5.0
NAMESPACE = "folio"


@dataclass(frozen=True)
class ReplicaReport:
    replica: str  # Ray Serve's id for the replica
    role: str  # "engine", "prefill" or "decode"
    pid: int
    host: str
    alive: bool  # its engine thread is running
    running: int
    waiting: int
    kv_usage: float
    metrics_text: str  # its registry in Prometheus' text format
    posted_at: float = 0.0  # wall clock (the board's)


@ray.remote(num_cpus=0)
class ReportBoard:
    def __init__(self) -> None:
        self._reports: dict[str, ReplicaReport] = {}

    def post(self, report: ReplicaReport) -> None:
        self._reports[report.replica] = ReplicaReport(**{**report.__dict__, "posted_at": time.time()})

    def withdraw(self, replica: str) -> None:
        self._reports.pop(replica, None)

    def fresh(self, max_age_s: float = STALE_AFTER_S) -> list[ReplicaReport]:
        now = time.time()
        self._reports = {k: r for k, r in self._reports.items() if now - r.posted_at <= max_age_s}
        return sorted(self._reports.values(), key=lambda r: r.replica)


def board_for(app_name: str) -> ray.actor.ActorHandle:
    """The application's board, created by whichever side asks first. Detached, so it outlives the
    replica that created it; `deploy.stop` kills it with the application."""
    return ReportBoard.options(  # type: ignore[attr-defined]
        name=f"board:{app_name}", namespace=NAMESPACE, get_if_exists=True, lifetime="detached"
    ).remote()
