"""What a running `folio serve` holds, read from outside: /health, and from /metrics the engine requests
holding admission slots, running and waiting, and the KV cache in use. After a robustness run all must
settle back to zero on a live server: anything else is a leak."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from prometheus_client.parser import text_string_to_metric_families

_GAUGES = {
    "folio:num_requests_admitted": "admitted",
    "folio:num_requests_running": "running",
    "folio:num_requests_waiting": "waiting",
    "folio:kv_cache_usage_ratio": "kv_cache_usage",
}


@dataclass(frozen=True)
class ServerState:
    healthy: bool
    admitted: float | None = None
    running: float | None = None
    waiting: float | None = None
    kv_cache_usage: float | None = None

    @property
    def settled(self) -> bool:
        """Alive, and holding nothing for anybody."""
        values = (self.admitted, self.running, self.waiting, self.kv_cache_usage)
        return self.healthy and all(v == 0 for v in values)

    def to_dict(self) -> dict[str, float | bool | None]:
        return asdict(self)


def read_server_state(base_url: str, timeout: float = 10.0) -> ServerState:
    import httpx  # imported only where a server is asked

    try:
        healthy = httpx.get(f"{base_url}/health", timeout=timeout).status_code == 200
        text = httpx.get(f"{base_url}/metrics", timeout=timeout).text
    except httpx.HTTPError:
        return ServerState(healthy=False)
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in _GAUGES:
                values[_GAUGES[sample.name]] = sample.value
    return ServerState(healthy=healthy, **values)


def wait_until_settled(base_url: str, timeout: float = 30.0) -> ServerState:
    """The server's state once it settles, or as it is when `timeout` runs out."""
    deadline = time.monotonic() + timeout
    state = read_server_state(base_url)
    while not state.settled and time.monotonic() < deadline:
        time.sleep(0.2)
        state = read_server_state(base_url)
    return state
