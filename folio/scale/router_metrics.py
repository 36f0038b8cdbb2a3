"""The router's counters. Ray Serve ships the request router's module by value to the process that
routes, so they live here, in a module shipped by reference, and the ingress serves this registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

ROUTER_REGISTRY = CollectorRegistry()
ROUTED = Counter("folio:router_requests", "Prompts routed to a replica, by why that replica was chosen.",
                 ["replica", "reason"], registry=ROUTER_REGISTRY)  # fmt: skip
MATCHED_BLOCKS = Counter("folio:router_prefix_matched_blocks", "Leading prompt blocks the chosen replica was "
                         "recorded as holding.", ["replica"], registry=ROUTER_REGISTRY)  # fmt: skip
