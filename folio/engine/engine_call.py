"""A function the engine thread runs between two steps on a caller's behalf (AsyncEngine.call): it sees
the engine core with no step half done, and its result or exception goes back to the caller's loop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass

from folio.engine.engine_core import EngineCore


@dataclass
class EngineCall:
    """A function to run on the engine thread between steps, its result handed back to an event loop."""

    fn: Callable[[EngineCore], object]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[object]

    def settle(self, engine: EngineCore) -> None:
        try:
            result, error = self.fn(engine), None
        except Exception as exc:
            result, error = None, exc
        with contextlib.suppress(RuntimeError):  # the caller's loop has closed: nobody is waiting
            self.loop.call_soon_threadsafe(self._resolve, result, error)

    def fail(self, error: Exception) -> None:
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self._resolve, None, error)

    def _resolve(self, result: object, error: Exception | None) -> None:
        if self.future.done():  # the caller gave up waiting
            return
        if error is not None:
            self.future.set_exception(error)
        else:
            self.future.set_result(result)
