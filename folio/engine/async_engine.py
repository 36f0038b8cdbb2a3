"""The narrow async interface the server talks to: the engine loop runs in a background thread.

Requests and aborts reach the loop through a thread-safe inbox; each request's updates come back
through its own asyncio queue, so a slow client only slows its own stream, never the loop. Keeping the
interface this small (add, stream updates, abort) is what lets the loop move to a subprocess later.

Detokenizing and stop strings happen here, on the engine side, so a request that hits a stop string
frees its KV blocks in the same step and is counted as finished with reason "stop".
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from folio.engine.engine_core import EngineCore
from folio.engine.output_processor import IncrementalDetokenizer, detokenize_step
from folio.engine.request import FinishReason, Request
from folio.loaders.tokenizer import Tokenizer
from folio.outputs import TokenLogprob
from folio.sampling_params import SamplingParams

logger = logging.getLogger("folio")


@dataclass
class RequestUpdate:
    text: str  # new text that is safe to show (stop strings cut, partial characters held back)
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    new_logprobs: list[TokenLogprob] = field(default_factory=list)


class EngineObserver(Protocol):
    """Called on the engine thread: after every step, and once per request that ends (any reason)."""

    def on_step(self, updated: list[Request], now: float) -> None: ...

    def on_finished(self, request: Request, now: float) -> None: ...


@dataclass
class _Stream:
    request: Request
    loop: asyncio.AbstractEventLoop
    updates: asyncio.Queue[RequestUpdate | BaseException]
    detokenizer: IncrementalDetokenizer
    num_sent: int = 0


@dataclass
class _AddGroup:
    streams: list[_Stream]  # the first computes the prompt; the rest fork from it


@dataclass
class _Abort:
    request_id: str


class AsyncEngine:
    def __init__(
        self,
        engine: EngineCore,
        tokenizer: Tokenizer,
        eos_token_ids: frozenset[int],
        observer: EngineObserver | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.observer = observer
        self._inbox: queue.Queue[_AddGroup | _Abort | None] = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="folio-engine", daemon=True)
        self._thread.start()

    # -- client side (event loop) ------------------------------------------------------------------
    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, cache_salt: str | None = None, priority: int = 0
    ) -> AsyncIterator[RequestUpdate]:
        """Stream a request's updates; closing or cancelling the consumer aborts it within one step.

        The request reaches the engine on the first iteration. One the engine refuses (e.g. a prompt
        longer than the context) raises ValueError there.
        """
        stream = self._new_stream(prompt_token_ids, params, cache_salt, priority)
        self._inbox.put(_AddGroup([stream]))
        async for update in self._consume(stream):
            yield update

    def generate_samples(
        self,
        prompt_token_ids: list[int],
        params: list[SamplingParams],
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> list[AsyncIterator[RequestUpdate]]:
        """Several samples of one prompt, submitted now: the first computes the prompt and the others
        fork from it, sharing its KV blocks. Each stream must be consumed or closed."""
        streams = [self._new_stream(prompt_token_ids, p, cache_salt, priority) for p in params]
        self._inbox.put(_AddGroup(streams))
        return [self._consume(s) for s in streams]

    def _new_stream(
        self, prompt_token_ids: list[int], params: SamplingParams, cache_salt: str | None, priority: int
    ) -> _Stream:
        request = Request(
            f"req-{next(self._ids)}",
            prompt_token_ids,
            params,
            eos_token_ids=self.eos_token_ids,
            cache_salt=cache_salt,
            priority=priority,
        )
        detokenizer = IncrementalDetokenizer(self.tokenizer, params.stop, params.include_stop_str_in_output)
        return _Stream(request, asyncio.get_running_loop(), asyncio.Queue(), detokenizer)

    async def _consume(self, stream: _Stream) -> AsyncIterator[RequestUpdate]:
        finished = False
        try:
            while not finished:
                update = await stream.updates.get()
                if isinstance(update, BaseException):
                    finished = True
                    raise update
                finished = update.finished
                yield update
        finally:
            if not finished:
                self._inbox.put(_Abort(stream.request.request_id))

    def shutdown(self) -> None:
        self._inbox.put(None)
        self._thread.join(timeout=10)

    # -- engine side (background thread) -----------------------------------------------------------
    def _run(self) -> None:
        stalled = False  # the last step scheduled nothing: requests wait for a batch to form
        while True:
            # Wait for work when idle (or, stalled, until a dynamic batch times out); otherwise just
            # drain what arrived since the last step.
            timeout: float | None = 0.0
            if not self.engine.has_unfinished():
                timeout = None
            elif stalled:
                timeout = self.engine.scheduler.seconds_until_batch()
            while True:
                try:
                    message = self._inbox.get(timeout=timeout) if timeout != 0.0 else self._inbox.get_nowait()
                except queue.Empty:
                    break
                if message is None:
                    return
                self._handle(message)
                timeout = 0.0
            if self.engine.has_unfinished():
                try:
                    updated = self.engine.step()
                except Exception as exc:  # a bug must fail the requests in flight, not hang them forever
                    logger.exception("engine step failed; failing the requests in flight")
                    self._fail_all(exc)
                    continue
                stalled = self.engine.last_step is not None and self.engine.last_step.num_batched_tokens == 0
                if self.observer is not None:
                    self.observer.on_step(updated, time.monotonic())
                for request in updated:
                    self._publish(request)

    def _fail_all(self, exc: Exception) -> None:
        for request_id, stream in list(self._streams.items()):
            self.engine.abort_request(request_id)
            error = RuntimeError(f"the engine failed: {exc}")
            stream.loop.call_soon_threadsafe(stream.updates.put_nowait, error)
        self._streams.clear()

    def _handle(self, message: _AddGroup | _Abort) -> None:
        if isinstance(message, _Abort):
            request = self.engine.abort_request(message.request_id)
            self._streams.pop(message.request_id, None)
            if request is not None and self.observer is not None:
                self.observer.on_finished(request, time.monotonic())
            return
        first, *forks = message.streams
        try:
            self.engine.add_request(first.request, [s.request for s in forks])
        except ValueError as exc:  # e.g. prompt longer than the context: hand the error to the callers
            for stream in message.streams:
                stream.loop.call_soon_threadsafe(stream.updates.put_nowait, exc)
            return
        for stream in message.streams:
            self._streams[stream.request.request_id] = stream

    def _publish(self, request: Request) -> None:
        stream = self._streams.get(request.request_id)
        if stream is None:
            return
        new_tokens = request.output_token_ids[stream.num_sent :]
        text = detokenize_step(stream.detokenizer, request, new_tokens)
        if stream.detokenizer.stopped and not request.is_finished:
            self.engine.abort_request(request.request_id, FinishReason.STOP)
        update = RequestUpdate(
            text=text,
            new_token_ids=list(new_tokens),
            finished=request.is_finished,
            finish_reason=request.finish_reason.value if request.finish_reason else None,
            num_prompt_tokens=request.num_prompt_tokens,
            new_logprobs=list(request.output_logprobs[stream.num_sent :]),
        )
        stream.num_sent = len(request.output_token_ids)
        if request.is_finished:
            del self._streams[request.request_id]
            if self.observer is not None:
                self.observer.on_finished(request, time.monotonic())
        stream.loop.call_soon_threadsafe(stream.updates.put_nowait, update)
