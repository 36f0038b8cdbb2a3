"""`/metrics` of the Ray endpoint: every replica's folio metrics, each series labelled by its replica.

Replicas post their registry as Prometheus text (board.py); this collector parses the latest posts
with prometheus_client's own parser and serves one family per metric name, the replicas' samples side
by side, plus `folio:replica_info` naming each replica's process. Admission is the ingress's (it counts
requests for all replicas); a replica's registry has none (server/metrics.track_admission).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from folio.scale_out.board import ReplicaReport


class ReplicaMetricsCollector:
    def __init__(self, reports: Callable[[], list[ReplicaReport]]) -> None:
        self._reports = reports

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for report in self._reports():
            for family in text_string_to_metric_families(report.metrics_text):
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(family.name, family.documentation, family.type)
                merged.samples.extend(
                    Sample(
                        s.name,
                        {**s.labels, "replica": report.replica, "role": report.role},
                        s.value,
                        s.timestamp,
                        s.exemplar,
                    )
                    for s in family.samples
                )
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
