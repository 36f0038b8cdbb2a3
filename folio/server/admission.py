"""Bounded admission: at most `max_num_seqs` requests run and `max_queue` more wait; beyond that, 429.

Counting happens at the server, per engine request (n choices count n), so the engine's own queue can
never grow without bound however fast clients send.
"""

from __future__ import annotations

from folio.server.errors import APIError

RETRY_AFTER_SECONDS = 1


class Admission:
    def __init__(self, max_num_seqs: int, max_queue: int) -> None:
        if max_num_seqs < 1 or max_queue < 0:
            raise ValueError("max_num_seqs must be >= 1 and max_queue >= 0")
        self.limit = max_num_seqs + max_queue
        self.in_flight = 0

    def acquire(self, count: int) -> None:
        """Reserve `count` engine requests or raise a 429 (the event loop is single-threaded: no lock)."""
        if self.in_flight + count > self.limit:
            raise APIError(
                429,
                f"the server is at capacity ({self.in_flight} requests running or queued, limit {self.limit}); "
                "retry shortly",
                code="queue_full",
                headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
            )
        self.in_flight += count

    def release(self, count: int) -> None:
        self.in_flight -= count
