"""What both robustness benchmarks (`folio bench fuzz`, `folio bench overload`) record: every answer by
status, the failures with a few samples, and the server's state once the load is over."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from folio_tools.bench.harness.server_state import wait_until_settled

MAX_SAMPLES = 20


@dataclass
class RobustnessRun:
    requests: int = 0
    by_status: dict[str, int] = field(default_factory=dict)  # "200", "429", ..., "no answer"
    failures: int = 0
    samples: list[Any] = field(default_factory=list)  # the first failures, described
    final_state: dict[str, Any] = field(default_factory=dict)  # ServerState once settled, plus "settled"
    elapsed_s: float = 0.0
    command: str = ""
    date_utc: str = ""
    server: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.failures == 0 and bool(self.final_state.get("settled"))

    def record(self, status: str, problem: str | None, sample: Any = None) -> None:
        """One answer; `problem` (None if fine) makes it a failure, kept with `sample` while few."""
        self.requests += 1
        self.by_status[status] = self.by_status.get(status, 0) + 1
        if problem is not None:
            self.failures += 1
            if len(self.samples) < MAX_SAMPLES:
                self.samples.append(sample if sample is not None else problem)

    def settle(self, base_url: str) -> None:
        """Wait for the server to hold nothing (or time out), and record how it ended."""
        state = wait_until_settled(base_url)
        self.final_state = {**state.to_dict(), "settled": state.settled}
        self.by_status = dict(sorted(self.by_status.items()))

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed}


def stream_error(text: str) -> dict[str, Any] | None:
    """The error object of a server-sent event stream's first error event, or None. Each event is parsed:
    a chunk whose generated text is "error" must not count."""
    for line in text.splitlines():
        if line.startswith("data: {"):
            try:
                event = json.loads(line.removeprefix("data: "))
            except ValueError:
                return {"message": f"an event that is not JSON: {line[:200]}"}
            if isinstance(event, dict) and "error" in event:
                return event["error"] if isinstance(event["error"], dict) else {"message": str(event["error"])}
    return None
