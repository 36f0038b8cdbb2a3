"""The narrow async interface the server talks to: the engine loop runs in a background thread.

Requests and aborts reach the loop through a thread-safe inbox; each request's new tokens come back
through its own asyncio queue, so a slow client only slows its own stream, never the loop. Keeping the
interface this small (add, stream updates, abort) is what lets the loop move to a subprocess later.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from folio.engine.engine_core import EngineCore
from folio.engine.request import Request
from folio.sampling_params import SamplingParams


@dataclass
class RequestUpdate:
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int


@dataclass
class _Add:
    request: Request
    loop: asyncio.AbstractEventLoop
    updates: asyncio.Queue[RequestUpdate | BaseException]


@dataclass
class _Abort:
    request_id: str


class AsyncEngine:
    def __init__(self, engine: EngineCore, eos_token_ids: frozenset[int]) -> None:
        self.engine = engine
        self.eos_token_ids = eos_token_ids
        self._inbox: queue.Queue[_Add | _Abort | None] = queue.Queue()
        self._streams: dict[str, _Add] = {}
        self._sent: dict[str, int] = {}
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="folio-engine", daemon=True)
        self._thread.start()

    # -- client side (event loop) ------------------------------------------------------------------
    async def generate(self, prompt_token_ids: list[int], params: SamplingParams) -> AsyncIterator[RequestUpdate]:
        """Stream a request's updates; cancelling the consumer aborts the request within one step."""
        request = Request(f"req-{next(self._ids)}", prompt_token_ids, params, eos_token_ids=self.eos_token_ids)
        updates: asyncio.Queue[RequestUpdate | BaseException] = asyncio.Queue()
        self._inbox.put(_Add(request, asyncio.get_running_loop(), updates))
        finished = False
        try:
            while not finished:
                update = await updates.get()
                if isinstance(update, BaseException):
                    raise update
                finished = update.finished
                yield update
        finally:
            if not finished:
                self._inbox.put(_Abort(request.request_id))

    def shutdown(self) -> None:
        self._inbox.put(None)
        self._thread.join(timeout=10)

    # -- engine side (background thread) -----------------------------------------------------------
    def _run(self) -> None:
        while True:
            # Block for work only when idle; otherwise just drain what arrived since the last step.
            block = not self.engine.has_unfinished()
            while True:
                try:
                    message = self._inbox.get(block=block, timeout=None)
                except queue.Empty:
                    break
                if message is None:
                    return
                self._handle(message)
                block = False
            if self.engine.has_unfinished():
                for request in self.engine.step():
                    self._publish(request)

    def _handle(self, message: _Add | _Abort) -> None:
        if isinstance(message, _Abort):
            self.engine.abort_request(message.request_id)
            self._streams.pop(message.request_id, None)
            self._sent.pop(message.request_id, None)
            return
        try:
            self.engine.add_request(message.request)
        except ValueError as exc:  # e.g. prompt longer than the context: hand the error to the caller
            message.loop.call_soon_threadsafe(message.updates.put_nowait, exc)
            return
        self._streams[message.request.request_id] = message
        self._sent[message.request.request_id] = 0

    def _publish(self, request: Request) -> None:
        stream = self._streams.get(request.request_id)
        if stream is None:
            return
        sent = self._sent[request.request_id]
        update = RequestUpdate(
            new_token_ids=list(request.output_token_ids[sent:]),
            finished=request.is_finished,
            finish_reason=request.finish_reason.value if request.finish_reason else None,
            num_prompt_tokens=request.num_prompt_tokens,
        )
        self._sent[request.request_id] = len(request.output_token_ids)
        if request.is_finished:
            del self._streams[request.request_id], self._sent[request.request_id]
        stream.loop.call_soon_threadsafe(stream.updates.put_nowait, update)
