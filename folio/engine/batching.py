"""Request-level batching policies, to compare with continuous batching on the same engine.

- `continuous` (default): iteration-level scheduling; a request joins the running batch at any step.
- `static`: a batch forms only when the previous one has finished and `batch_size` requests are
  waiting; nobody joins it until all its members finish. A partial batch waits for more requests,
  except in the offline API, where every request is known up front (`flush`).
- `dynamic`: as static, but a batch also forms when the oldest waiting request has waited
  `batch_timeout` seconds, whichever comes first.

The gate only decides who may be admitted; chunked prefill, the token budget and preemption work as
in continuous batching, so the comparison isolates the batching decision.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from folio.engine.request import Request

BATCHING_POLICIES = ("continuous", "static", "dynamic")


class BatchGate:
    def __init__(self, policy: str, batch_size: int, timeout_s: float) -> None:
        if policy not in BATCHING_POLICIES:
            raise ValueError(f"batching must be one of {', '.join(BATCHING_POLICIES)}, got {policy!r}")
        if batch_size < 1 or timeout_s < 0:
            raise ValueError("batch_size must be >= 1 and batch_timeout >= 0")
        self.policy = policy
        self.batch_size = batch_size
        self.timeout_s = timeout_s
        self.flush = False  # no more requests will arrive: run a partial batch
        self.members: set[str] = set()  # the current batch, until each member finishes

    @property
    def continuous(self) -> bool:
        return self.policy == "continuous"

    def admits(self, request: Request) -> bool:
        return self.continuous or request.request_id in self.members

    def maybe_form(self, waiting: Sequence[Request], now: float) -> None:
        """Start the next batch from the head of the queue if the policy says it is time."""
        if self.continuous or self.members or not waiting:
            return
        full = len(waiting) >= self.batch_size
        if full or self.flush or self.seconds_until_ready(waiting, now) == 0.0:
            self.members = {r.request_id for r in waiting[: self.batch_size]}

    def seconds_until_ready(self, waiting: Sequence[Request], now: float) -> float | None:
        """For an idle engine: how long until a dynamic batch times out; None to wait for requests."""
        if self.policy != "dynamic" or self.members or not waiting:
            return None
        oldest = min(r.arrival_time for r in waiting)
        return max(0.0, self.timeout_s - (now - oldest))

    def join(self, request_id: str) -> None:
        """A fork of a member belongs to its batch."""
        if not self.continuous:
            self.members.add(request_id)

    def leave(self, request_id: str) -> None:
        self.members.discard(request_id)
