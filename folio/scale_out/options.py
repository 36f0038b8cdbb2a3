"""How `folio serve --replicas` places and scales its engine replicas (no Ray import: the CLI reads it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from folio.scale_out.routing import RoutingConfig

APP_NAME = "folio"


@dataclass(frozen=True)
class ReplicaOptions:
    replicas: int = 1  # a fixed count, unless min/max replicas turn autoscaling on
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float = 16.0  # per replica: the autoscaler adds replicas above this queue depth
    downscale_delay: float = 60.0  # seconds below the target before the autoscaler removes a replica
    cpus_per_replica: float | None = None  # None: the node's CPUs over the replicas (at least 1)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    ray_address: str | None = None  # None: start a local Ray instance ("auto": join the running cluster)
    app_name: str = APP_NAME
    # Prefill/decode disaggregation: `replicas` (or the autoscaled bounds) are the decode replicas, and
    # `prefill_replicas` more compute prompts for them.
    disaggregate: bool = False
    prefill_replicas: int = 1

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {self.replicas}")
        low, high = self.min_replicas, self.max_replicas
        if (low is None) != (high is None):
            raise ValueError("give --min-replicas and --max-replicas together (autoscaling needs both bounds)")
        if low is not None and high is not None and not 0 <= low <= high or high == 0:
            raise ValueError(f"autoscaling needs 0 <= --min-replicas <= --max-replicas and max >= 1, got {low}, {high}")
        if self.cpus_per_replica is not None and not self.cpus_per_replica > 0:
            raise ValueError(f"--cpus-per-replica must be > 0, got {self.cpus_per_replica}")
        if self.prefill_replicas < 1:
            raise ValueError(f"--prefill-replicas must be >= 1, got {self.prefill_replicas}")
        if not self.target_ongoing_requests > 0:
            raise ValueError(f"the autoscaling target must be > 0 requests, got {self.target_ongoing_requests}")
        if not self.downscale_delay >= 0:
            raise ValueError(f"--downscale-delay must be >= 0 seconds, got {self.downscale_delay}")

    @property
    def autoscaling(self) -> bool:
        return self.max_replicas is not None

    @property
    def most_replicas(self) -> int:
        """Of the replicas the ingress sends requests to (the decode ones when disaggregated)."""
        return self.max_replicas if self.max_replicas is not None else self.replicas

    @property
    def most_engines(self) -> int:
        """Every engine replica, prefill included: what the CPUs are shared among."""
        return self.most_replicas + (self.prefill_replicas if self.disaggregate else 0)
