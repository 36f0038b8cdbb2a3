"""The narrow async interface the server talks to: the engine loop runs in a background thread.

Requests and aborts reach the loop through a thread-safe inbox; the updates of one API call's requests
come back on that call's own asyncio queue (`Generation`), so a slow client only slows its own stream,
never the loop. Keeping the interface this small (submit, stream updates, abort) is what lets the loop
move to a subprocess later.

Detokenizing and stop strings happen here, on the engine side, so a request that hits a stop string
frees its KV blocks in the same step and is counted as finished with reason "stop".

Faults: one request's fault (its row in the sampler, its grammar, its detokenizer) ends that request
with an error and the rest of the batch goes on. If the engine thread itself dies (any BaseException),
every waiting caller gets `EngineDeadError` at once, later submissions are refused, and `on_death` is
called so the server can report unhealthy and exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import torch

from folio.engine.engine_call import EngineCall
from folio.engine.engine_core import EngineCore
from folio.engine.output_processor import OutputDelta, OutputProcessor
from folio.engine.request import FinishReason, Request
from folio.loaders.tokenizer import Tokenizer
from folio.outputs import TokenLogprob
from folio.platform import release_openmp_workers
from folio.sampling_params import SamplingParams
from folio.worker.executor import WorkerDiedError

logger = logging.getLogger("folio")
T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine thread has stopped: nothing runs until the process restarts."""


class RequestFailedError(RuntimeError):
    """A fault inside the engine ended one request; the others in its batch went on."""


@dataclass
class RequestUpdate:
    text: str  # new text that is safe to show (stop strings cut, partial characters held back)
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    error: str | None = None  # set with finish_reason "error"
    prompt_logprobs: list[TokenLogprob | None] | None = None  # in the first update, if asked for
    embedding: torch.Tensor | None = None  # an embedding request's vector, in its one (finished) update
    stop_reason: str | None = None  # the stop string that ended the request (Anthropic's stop_sequence)


class EngineObserver(Protocol):
    """Called on the engine thread: after every step, and once per request that ends (any reason)."""

    def on_step(self, updated: list[Request], now: float) -> None: ...

    def on_finished(self, request: Request, now: float) -> None: ...


@dataclass(eq=False)
class _Mailbox:
    """Where the engine thread posts one Generation's updates. The engine holds this, not the Generation,
    so a Generation nobody holds any more is collected, and its __del__ aborts its requests."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[tuple[int, RequestUpdate] | BaseException]

    def post(self, item: tuple[int, RequestUpdate] | BaseException) -> None:
        """Called on the engine thread. A closed event loop means nobody is listening any more."""
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


@dataclass
class _Stream:
    request: Request
    mailbox: _Mailbox
    index: int  # the choice this request answers


@dataclass
class _AddGroup:
    streams: list[_Stream]  # the first computes the prompt; the rest fork from it


@dataclass
class _Abort:
    request_id: str


def take_update(
    item: tuple[int, RequestUpdate] | BaseException, close: Callable[[], None], finished: Callable[[int], object]
) -> tuple[int, RequestUpdate]:
    """One item of an API call's update queue: a failure closes the call and is raised; a finished choice
    is reported to `finished`, and raised as RequestFailedError if it ended in error."""
    if isinstance(item, BaseException):
        close()
        raise item
    index, update = item
    if update.finished:
        finished(index)
        if update.error is not None:
            close()
            raise RequestFailedError(update.error)
    return index, update


class Generation:
    """The engine requests behind one API call (prompts x samples), numbered as its choices.

    Their updates arrive on one queue as (choice index, update). Iterating ends when every choice has
    finished; a failed choice or a dead engine raises. `close()` aborts every choice that has not
    finished: it is synchronous and idempotent, so it is safe in any finally block, a cancelled
    task's included, and it also runs if the object is dropped unclosed.
    """

    _open: dict[int, str] = {}  # class defaults: __del__ must work even if __init__ failed
    _closed = True

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self._mailbox = _Mailbox(asyncio.get_running_loop(), asyncio.Queue())
        self._open = {}  # choice index -> request id, until that choice finishes
        self._num_choices = 0
        self._closed = False

    def add(
        self, prompt_token_ids: list[int], params: list[SamplingParams], cache_salt: str | None = None,
        priority: int = 0,
    ) -> None:  # fmt: skip
        """The samples of one prompt, as the next choices: the first computes the prompt and the others
        fork from it, sharing its KV blocks. Raises EngineDeadError if the engine has died."""
        streams = []
        for sample in params:
            request = self._engine.new_request(prompt_token_ids, sample, cache_salt, priority)
            streams.append(_Stream(request, self._mailbox, self._num_choices))
            self._num_choices += 1
        self._engine.submit(streams)
        self._open.update({s.index: s.request.request_id for s in streams})

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> tuple[int, RequestUpdate]:
        if not self._open:
            raise StopAsyncIteration
        item = await self._mailbox.queue.get()
        return take_update(item, self.close, lambda index: self._open.pop(index, None))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for request_id in self._open.values():
            self._engine.abort(request_id)
        self._open = {}

    def __del__(self) -> None:
        self.close()


class AsyncEngine:
    def __init__(
        self,
        engine: EngineCore,
        tokenizer: Tokenizer,
        eos_token_ids: frozenset[int],
        observer: EngineObserver | None = None,
        on_death: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.engine = engine
        # Online, requests keep arriving: a static batch waits to be full (the offline LLM flushes).
        engine.scheduler.gate.flush = False
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.observer = observer
        self.on_death = on_death
        self.dead: BaseException | None = None  # why the engine thread died
        self._lock = threading.Lock()  # orders submissions against the engine's death
        self._inbox: queue.Queue[_AddGroup | _Abort | EngineCall | None] = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._outputs = OutputProcessor(engine, tokenizer)  # used on the engine thread only
        self._ids = itertools.count()
        # From here the engine steps on its own thread: this one's OpenMP workers, started by loading the
        # model, would leave libgomp managing more threads than cores, and it then stops spinning at the
        # barriers of every kernel (platform.release_openmp_workers).
        release_openmp_workers()
        self._thread = threading.Thread(target=self._run, name="folio-engine", daemon=True)
        self._thread.start()

    # -- client side (event loop) ------------------------------------------------------------------
    def generation(self) -> Generation:
        """A new API call's requests (add prompts to it, then iterate its updates)."""
        return Generation(self)

    @property
    def is_alive(self) -> bool:
        return self.dead is None and self._thread.is_alive()

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def new_request(
        self, prompt_token_ids: list[int], params: SamplingParams, cache_salt: str | None, priority: int
    ) -> Request:
        return Request(f"req-{next(self._ids)}", prompt_token_ids, params, eos_token_ids=self.eos_token_ids,
                       cache_salt=cache_salt, priority=priority)  # fmt: skip

    def submit(self, streams: list[_Stream]) -> None:
        with self._lock:
            if self.dead is not None:
                raise EngineDeadError("the engine has stopped after an internal error")
            self._inbox.put(_AddGroup(streams))

    def abort(self, request_id: str) -> None:
        """Thread-safe; the engine drops the request (and frees its blocks) before its next step."""
        self._inbox.put(_Abort(request_id))

    async def call(self, fn: Callable[[EngineCore], T]) -> T:
        """Run `fn(engine core)` on the engine thread between two steps (it sees no step half done) and
        return its result or raise its exception."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[object] = loop.create_future()
        with self._lock:
            if self.dead is not None:
                raise EngineDeadError("the engine has stopped after an internal error")
            self._inbox.put(EngineCall(fn, loop, future))
        return await future  # type: ignore[return-value]

    def shutdown(self) -> None:
        self._inbox.put(None)
        self._thread.join(timeout=10)
        self.engine.shutdown()

    # -- engine side (background thread) -----------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # a panic in native code is a BaseException too
            self._die(exc)
            return
        self._fail_every_stream(EngineDeadError("the server is shutting down"))

    def _loop(self) -> None:
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
                except WorkerDiedError:  # the model itself is gone: nothing can run again
                    raise
                except Exception:  # not one row's fault: fail the requests in flight, keep serving
                    logger.exception("engine step failed; failing the requests in flight")
                    self._fail_in_flight("the engine failed while running this request's batch")
                    continue
                stalled = self.engine.stalled
                self._observe_step(updated)
                for delta in self._outputs.process(updated):
                    self._publish(delta)

    def _die(self, exc: BaseException) -> None:
        logger.critical("the engine thread died; failing every request", exc_info=exc)
        with self._lock:
            self.dead = exc
        error = EngineDeadError("the engine has stopped after an internal error")
        self._fail_every_stream(error)
        if self.on_death is not None:
            self.on_death(exc)

    def _fail_every_stream(self, error: BaseException) -> None:
        """Hand `error` to every caller still waiting, including submissions never picked up."""
        mailboxes = {s.mailbox for s in self._streams.values()}
        self._streams.clear()
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(message, _AddGroup):
                mailboxes.update(s.mailbox for s in message.streams)
            elif isinstance(message, EngineCall):
                message.fail(EngineDeadError(str(error)))
        for mailbox in mailboxes:
            mailbox.post(error)

    def _fail_in_flight(self, error: str) -> None:
        for stream in list(self._streams.values()):
            self._fail(stream, error)

    def _fail(self, stream: _Stream, error: str) -> None:
        """End one request with an error, however far it got."""
        request = stream.request
        self._outputs.fail(request, error)
        self._streams.pop(request.request_id, None)
        self._outputs.forget(request.request_id)
        self._observe_finished(request)
        update = RequestUpdate("", [], True, FinishReason.ERROR.value, request.num_prompt_tokens, error=error)
        stream.mailbox.post((stream.index, update))

    def _handle(self, message: _AddGroup | _Abort | EngineCall) -> None:
        if isinstance(message, EngineCall):
            message.settle(self.engine)
            return
        if isinstance(message, _Abort):
            request = self.engine.abort_request(message.request_id)
            self._streams.pop(message.request_id, None)
            self._outputs.forget(message.request_id)
            if request is not None:
                self._observe_finished(request)
            return
        first, *forks = message.streams
        try:
            self.engine.add_request(first.request, [s.request for s in forks])
        except ValueError as exc:  # e.g. prompt longer than the context: hand the error to the caller
            first.mailbox.post(exc)
            return
        except Exception:
            logger.exception("could not add request %s", first.request.request_id)
            first.mailbox.post(RequestFailedError("the engine could not accept this request"))
            return
        for stream in message.streams:
            self._streams[stream.request.request_id] = stream
            self._outputs.add(stream.request)

    def _publish(self, delta: OutputDelta) -> None:
        request = delta.request
        stream = self._streams.get(request.request_id)
        if stream is None:
            return
        if request.is_finished:
            del self._streams[request.request_id]
            self._outputs.forget(request.request_id)
            self._observe_finished(request)
        update = RequestUpdate(
            text=delta.text,
            new_token_ids=delta.new_token_ids,
            finished=request.is_finished,
            finish_reason=request.finish_reason.value if request.finish_reason else None,
            num_prompt_tokens=request.num_prompt_tokens,
            new_logprobs=delta.new_logprobs,
            error=request.error,
            prompt_logprobs=delta.prompt_logprobs,
            embedding=request.embedding,
            stop_reason=delta.stop_reason,
        )
        stream.mailbox.post((stream.index, update))

    def _observe_step(self, updated: list[Request]) -> None:
        if self.observer is not None:
            try:
                self.observer.on_step(updated, time.monotonic())
            except Exception:  # metrics must never fail requests
                logger.exception("the step observer failed")

    def _observe_finished(self, request: Request) -> None:
        if self.observer is not None:
            try:
                self.observer.on_finished(request, time.monotonic())
            except Exception:
                logger.exception("the request observer failed")
