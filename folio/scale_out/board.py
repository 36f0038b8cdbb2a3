"""Where replicas post what they report (liveness, load, their Prometheus metrics), for the ingress.

A Ray Serve handle sends a call to one replica, never to all, so each replica posts a `ReplicaReport`
every `REPORT_PERIOD_S` to one small named actor, and the ingress reads the fresh ones: `/health`
(some replica is alive) and `/metrics` (every replica's series, labelled by replica) answer from the
last read. A replica that stops posting drops out after `STALE_AFTER_S`.

`/metrics` (`ReplicaMetricsCollector`) parses the latest posts with prometheus_client's own parser and
serves one family per metric name, the replicas' samples side by side, plus `folio:replica_info` naming
each replica's process. Admission is the ingress's (it counts requests for all replicas); a replica's
registry has none (server/metrics.track_admission).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import ray
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

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


class ReplicaMetricsCollector:
    def __init__(self, reports: Callable[[], list[ReplicaReport]]) -> None:
        self._reports = reports

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for report in self._reports():
            labels = {"replica": report.replica, "role": report.role}
            for family in text_string_to_metric_families(report.metrics_text):
                merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                merged.samples.extend(s._replace(labels={**s.labels, **labels}) for s in family.samples)
        yield from families.values()
        info = Metric("folio:replica_info", "Each reporting replica's process; 1 while its engine runs.", "gauge")
        for report in self._reports():
            labels = {"replica": report.replica, "role": report.role, "pid": str(report.pid), "host": report.host}
            info.add_sample("folio:replica_info", labels, float(report.alive))
        yield info


# The router's counters. Ray Serve ships the request router's module by value to the process that
# routes, so they live here, in a module shipped by reference, and the ingress serves this registry.
ROUTER_REGISTRY = CollectorRegistry()
ROUTED = Counter("folio:router_requests", "Prompts routed to a replica, by why that replica was chosen.",
                 ["replica", "reason"], registry=ROUTER_REGISTRY)  # fmt: skip
MATCHED_BLOCKS = Counter("folio:router_prefix_matched_blocks", "Leading prompt blocks the chosen replica was "
                         "recorded as holding.", ["replica"], registry=ROUTER_REGISTRY)  # fmt: skip
