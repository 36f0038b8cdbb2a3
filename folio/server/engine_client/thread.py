"""The narrow async interface the server talks to: the engine loop runs in a background thread.

Requests and aborts reach the loop through a thread-safe inbox; the updates of one API call's requests
come back through that call's mailbox (updates.py): its own asyncio queue in this process, so a
slow client only slows its own stream, never the loop. In an engine process of its own
(process_main.py) this same loop posts to mailboxes that batch each step's updates onto the wire,
flushed by `flush` once the loop has posted a round's.

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
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar

from folio.engine.engine_core import EngineCore
from folio.engine.output_processor import OutputDelta, OutputProcessor
from folio.engine.request import FinishReason, Request
from folio.loaders.tokenizer import Tokenizer
from folio.lora.adapter import LoRARequest
from folio.platform import release_openmp_workers
from folio.sampling_params import SamplingParams
from folio.server.engine_client.generation import Generation
from folio.server.engine_client.updates import EngineDeadError, RequestFailedError, RequestUpdate, Stream
from folio.worker.executor import WorkerDiedError

logger = logging.getLogger("folio")
T = TypeVar("T")
Reply = Callable[[object, Exception | None], None]  # an engine call's result, or its exception


@dataclass
class EngineCall:
    """A function to run on the engine thread between steps; `reply` gets its result or its exception there."""

    fn: Callable[[EngineCore], object]
    reply: Reply

    def settle(self, engine: EngineCore) -> None:
        try:
            result, error = self.fn(engine), None
        except Exception as exc:
            result, error = None, exc
        self.reply(result, error)

    def fail(self, error: Exception) -> None:
        self.reply(None, error)


def _reply_to(loop: asyncio.AbstractEventLoop, future: asyncio.Future[object]) -> Reply:
    """An EngineCall's reply that settles `future` on its event loop."""

    def resolve(result: object, error: Exception | None) -> None:
        if future.done():  # the caller gave up waiting
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def reply(result: object, error: Exception | None) -> None:
        with contextlib.suppress(RuntimeError):  # the caller's loop has closed: nobody is waiting
            loop.call_soon_threadsafe(resolve, result, error)

    return reply


class EngineObserver(Protocol):
    """Called on the engine thread: after every step, and once per request that ends (any reason)."""

    def on_step(self, updated: list[Request], now: float) -> None: ...

    def on_finished(self, request: Request, now: float) -> None: ...


@dataclass
class _AddGroup:
    streams: list[Stream]  # the first computes the prompt; the rest fork from it


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
        on_death: Callable[[BaseException], None] | None = None,
        flush: Callable[[], None] | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.observer = observer
        self.on_death = on_death
        self._flush = flush or (lambda: None)  # after the loop has posted a round's updates
        self.dead: BaseException | None = None  # why the engine thread died
        self._lock = threading.Lock()  # orders submissions against the engine's death
        self._inbox: queue.Queue[_AddGroup | _Abort | EngineCall | None] = queue.Queue()
        self._streams: dict[str, Stream] = {}
        self._outputs = OutputProcessor(engine, tokenizer)  # used on the engine thread only
        self._ids = itertools.count()
        # From here the engine steps on its own thread: this one's OpenMP workers, started by loading the
        # model, would leave libgomp managing more threads than cores, and it then stops spinning at the
        # barriers of every kernel (platform.release_openmp_workers).
        release_openmp_workers()
        self._thread = threading.Thread(target=self._run, name="folio-engine", daemon=True)
        self._thread.start()

    # -- client side (event loop) ------------------------------------------------------------------
    def generation(self, lora_name: str | None = None) -> Generation:
        """A new API call's requests (add prompts to it, then iterate its updates), with a LoRA adapter."""
        return Generation(self, lora_name)

    @property
    def is_alive(self) -> bool:
        return self.dead is None and self._thread.is_alive()

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def new_request(
        self, prompt_token_ids: list[int], params: SamplingParams, cache_salt: str | None, priority: int,
        lora_name: str | None = None,
    ) -> Request:  # fmt: skip
        return Request(f"req-{next(self._ids)}", prompt_token_ids, params, eos_token_ids=self.eos_token_ids,
                       cache_salt=cache_salt, priority=priority, lora_name=lora_name)  # fmt: skip

    def submit(self, streams: list[Stream]) -> None:
        self._send(_AddGroup(streams))

    def _send(self, message: _AddGroup | EngineCall) -> None:
        """Into the inbox, or EngineDeadError: the lock orders this against the engine's death."""
        with self._lock:
            if self.dead is not None:
                raise EngineDeadError("the engine has stopped after an internal error")
            self._inbox.put(message)

    def abort(self, request_id: str) -> None:
        """Thread-safe; the engine drops the request (and frees its blocks) before its next step."""
        self._inbox.put(_Abort(request_id))

    async def call(self, fn: Callable[[EngineCore], T]) -> T:
        """Run `fn(engine core)` on the engine thread between two steps (it sees no step half done) and
        return its result or raise its exception."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[object] = loop.create_future()
        self._send(EngineCall(fn, _reply_to(loop, future)))
        return await future  # type: ignore[return-value]

    def call_then(self, fn: Callable[[EngineCore], object], reply: Reply) -> None:
        """`call` for a caller without an event loop (the engine process's receiver): `reply` gets the result
        or the exception, on the engine thread. EngineDeadError at once if the engine has stopped."""
        self._send(EngineCall(fn, reply))

    async def add_lora(self, request: LoRARequest) -> None:
        await self.call(lambda core: core.add_lora(request))

    async def remove_lora(self, name: str) -> bool:
        return await self.call(lambda core: core.remove_lora(name))

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
            self._flush()  # what the last round posted goes out before the loop waits or steps again
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
                self._observe("on_step", updated)
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
        self._flush()

    def _fail_in_flight(self, error: str) -> None:
        """End every request in flight with an error, however far each got."""
        for stream in list(self._streams.values()):
            request = stream.request
            self._outputs.fail(request, error)
            self._streams.pop(request.request_id, None)
            self._outputs.forget(request.request_id)
            self._observe("on_finished", request)
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
                self._observe("on_finished", request)
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
            self._observe("on_finished", request)
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
            num_cached_tokens=request.num_cached_tokens,
        )
        stream.mailbox.post((stream.index, update))

    def _observe(self, hook: Literal["on_step", "on_finished"], subject: list[Request] | Request) -> None:
        if self.observer is not None:
            try:
                getattr(self.observer, hook)(subject, time.monotonic())
            except Exception:  # metrics must never fail requests
                logger.exception("the engine observer's %s failed", hook)
