"""Bounded admission: at most `max_num_seqs` requests run and `max_queue` more wait; beyond that, 429.

Counting happens at the server, per engine request (n choices count n, a beam search its beams), so the
engine's own queue can never grow without bound however fast clients send. A request that alone needs
more than the whole limit gets a 400, since retrying could never help.

Slots are held by a `Reservation`, released exactly once however the API call ends: as a context
manager, by `release()` from a response's cleanup, or when the reservation is dropped unreleased.
"""

from __future__ import annotations

import threading
from types import TracebackType

from folio.server.errors import APIError

RETRY_AFTER_SECONDS = 1


class Admission:
    def __init__(self, max_num_seqs: int, max_queue: int) -> None:
        if max_num_seqs < 1 or max_queue < 0:
            raise ValueError("max_num_seqs must be >= 1 and max_queue >= 0")
        self.limit = max_num_seqs + max_queue
        self.in_flight = 0
        self._lock = threading.Lock()  # a dropped reservation may be collected on another thread

    def reserve(self, count: int, param: str = "n") -> Reservation:
        """Hold `count` engine requests, or raise: 400 if the request alone exceeds the limit, else 429."""
        if count > self.limit:
            raise APIError(
                400,
                f"this request needs {count} sequences at once but the server runs and queues at most {self.limit} "
                "(--max-num-seqs + --max-queue)",
                param=param,
            )
        with self._lock:
            if self.in_flight + count > self.limit:
                raise APIError(
                    429,
                    f"the server is at capacity ({self.in_flight} requests running or queued, limit {self.limit}); "
                    "retry shortly",
                    code="queue_full",
                    headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
                )
            self.in_flight += count
        return Reservation(self, count)

    def _give_back(self, count: int) -> None:
        with self._lock:
            self.in_flight -= count


class Reservation:
    def __init__(self, admission: Admission, count: int) -> None:
        self._admission = admission
        self.count = count
        self._held = True

    def release(self) -> None:
        """Idempotent: the first call gives the slots back, later calls do nothing."""
        if self._held:
            self._held = False
            self._admission._give_back(self.count)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()
