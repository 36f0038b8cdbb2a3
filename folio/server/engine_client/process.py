"""`ProcessEngine`: the API server's side of an engine running in a process of its own.

It is an `EngineClient` (protocol.py) and a `RequestSink` (generation.py), so the
routes and their `Generation`s work as with `AsyncEngine`. Requests and aborts go out on one socket;
a reader thread receives the engine's batches of updates and posts each to its call's mailbox (an
asyncio queue on the call's loop), as the engine thread does in one process.

The engine's death, whether it says so (`Died`) or its process just ends (a crash, a kill), fails
every open call at once, refuses new ones, and calls `on_death` so the server can stop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import shutil
import tempfile
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import zmq
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from folio.engine.request import Request
from folio.engine_args import EngineArgs
from folio.loaders.tokenizer import Tokenizer
from folio.lora.adapter import LoRARequest
from folio.sampling_params import SamplingParams
from folio.server.engine_client import wire
from folio.server.engine_client.generation import Generation
from folio.server.engine_client.process_main import run_engine_process
from folio.server.engine_client.updates import EngineDeadError, LoopMailbox, Mailbox, Stream

logger = logging.getLogger("folio")

READY_POLL_MS = 200
SHUTDOWN_TIMEOUT_S = 15.0  # the engine finishes its step and exits; then it is terminated
METRICS_TIMEOUT_S = 10.0


class EngineProcessDied(RuntimeError):
    """The engine process ended, or reported its loop dead, while serving."""


class StartCancelled(RuntimeError):
    """The engine's start was called off (its server is stopping) before the model had loaded."""


class EngineProcess:
    """A started engine process and the two IPC sockets to it, before any model is loaded: the process
    has imported torch and folio (seconds) and waits for its model (`wire.Load`). A server of several
    models keeps one started ahead, so that a load does not pay the imports."""

    def __init__(self) -> None:
        self.socket_dir = Path(tempfile.mkdtemp(prefix="folio-engine-"))  # mode 0700: only this user
        self.zmq = zmq.Context()
        self.outbound, self.inbound = self.zmq.socket(zmq.PUSH), self.zmq.socket(zmq.PULL)
        to_engine, from_engine = f"ipc://{self.socket_dir}/in", f"ipc://{self.socket_dir}/out"
        self.outbound.bind(to_engine)
        self.inbound.bind(from_engine)
        # spawn, not fork: this process has torch's and the event loop's threads, which fork would not copy.
        self.process = multiprocessing.get_context("spawn").Process(
            target=run_engine_process, name="folio-engine",
            args=(to_engine, from_engine, logging.getLogger("folio").getEffectiveLevel()),
        )  # fmt: skip
        self.process.start()

    def stop(self) -> None:
        self.end_process()
        self.close()

    def end_process(self, grace: float = 0.0) -> None:
        """After `grace` seconds to finish on its own, terminated, then killed."""
        self.process.join(grace)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()

    def close(self) -> None:
        self.outbound.close(linger=0)
        self.inbound.close(linger=0)
        self.zmq.term()
        shutil.rmtree(self.socket_dir, ignore_errors=True)


class ProcessEngine:
    def __init__(
        self, args: EngineArgs, model_name: str, on_death: Callable[[BaseException], None] | None = None,
        cancel: threading.Event | None = None, started: EngineProcess | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:  # fmt: skip
        """Load the model in an engine process (`started` ahead, or a new one) and wait until it is
        loaded. A model or flag it cannot load raises ValueError with its reason; `cancel`, set meanwhile,
        stops the start (StartCancelled). With `tokenizer` (this model's, kept from an earlier load), the
        engine does not send its own over the socket."""
        self.on_death = on_death
        self.dead: EngineProcessDied | None = None
        self._lock = threading.Lock()  # the outbound socket, and the engine's death against submissions
        self._stopping = False
        self._ids = itertools.count()
        self._mailbox_ids: weakref.WeakKeyDictionary[Mailbox, int] = weakref.WeakKeyDictionary()
        self._mailboxes: weakref.WeakValueDictionary[int, LoopMailbox] = weakref.WeakValueDictionary()
        self._next_mailbox = itertools.count()
        self._answers: dict[int, tuple[threading.Event, list[object]]] = {}  # queries' replies, by number
        self._queries = itertools.count()
        self._handle = started or EngineProcess()
        self.process = self._handle.process
        self._outbound, self._inbound = self._handle.outbound, self._handle.inbound
        try:
            self._outbound.send(wire.encode(wire.Load(args, model_name, send_tokenizer=tokenizer is None)))
            info = self._wait_until_ready(cancel)
        except BaseException:  # a failed start, or SIGTERM during it: leave nothing running
            self._handle.stop()
            raise
        self.info = info if tokenizer is None else replace(info, tokenizer=tokenizer)
        self._reader = threading.Thread(target=self._read, name="folio-engine-reader", daemon=True)
        self._reader.start()

    # -- EngineClient ----------------------------------------------------------------------------------
    @property
    def is_alive(self) -> bool:
        return self.dead is None and self.process.is_alive()

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    def generation(self, lora_name: str | None = None) -> Generation:
        return Generation(self, lora_name)

    # -- RequestSink (called by Generation, on the event loop) -----------------------------------------
    def new_request(
        self, prompt_token_ids: list[int], params: SamplingParams, cache_salt: str | None, priority: int,
        lora_name: str | None = None,
    ) -> Request:  # fmt: skip
        return Request(f"req-{next(self._ids)}", prompt_token_ids, params, eos_token_ids=self.info.eos_token_ids,
                       cache_salt=cache_salt, priority=priority, lora_name=lora_name)  # fmt: skip

    def submit(self, streams: list[Stream]) -> None:
        mailbox = streams[0].mailbox  # one call's streams share its mailbox
        assert isinstance(mailbox, LoopMailbox)
        with self._lock:
            if self.dead is not None:
                raise EngineDeadError("the engine has stopped after an internal error")
            number = self._mailbox_ids.get(mailbox)
            if number is None:
                number = self._mailbox_ids[mailbox] = next(self._next_mailbox)
                self._mailboxes[number] = mailbox
            self._outbound.send(wire.encode(wire.Submit(number, [s.request for s in streams], streams[0].index)))

    def abort(self, request_id: str) -> None:
        """Any thread (a Generation may be collected anywhere); nothing to do once the engine is gone."""
        with self._lock:
            if self.dead is None and not self._stopping:
                self._outbound.send(wire.encode(wire.Abort(request_id)))

    # -- queries (blocking until the engine's main thread answers: call them off the event loop) ---------
    def _ask(self, query_message: Callable[[int], object], timeout: float | None) -> object | None:
        """Send the message made for a new query number and wait for its answer (None: the engine has gone
        or did not answer in time)."""
        query, done, answer = next(self._queries), threading.Event(), []
        self._answers[query] = (done, answer)
        try:
            with self._lock:
                if self.dead is not None or self._stopping:
                    return None
                self._outbound.send(wire.encode(query_message(query)))
            done.wait(timeout)
            return answer[0] if answer else None
        finally:
            self._answers.pop(query, None)

    def metrics_text(self) -> str:
        """The engine's registry in Prometheus' text format, asked for now ("" if it cannot answer)."""
        reply = self._ask(wire.MetricsQuery, METRICS_TIMEOUT_S)
        return reply.text if isinstance(reply, wire.MetricsText) else ""

    def change_adapter(self, add: LoRARequest | None = None, remove: str | None = None) -> bool:
        """Register (or replace) a LoRA adapter in the engine, or remove one: whether a removal found it.
        ValueError if the engine cannot serve the adapter, EngineDeadError if the engine has gone."""
        reply = self._ask(lambda query: wire.AdapterChange(query, add, remove), None)
        if not isinstance(reply, wire.AdapterChanged):
            raise EngineDeadError("the engine has stopped")
        if reply.error is not None:
            raise (ValueError if reply.refused else RuntimeError)(reply.error)
        return reply.removed

    async def add_lora(self, request: LoRARequest) -> None:
        await asyncio.to_thread(self.change_adapter, add=request)

    async def remove_lora(self, name: str) -> bool:
        return await asyncio.to_thread(self.change_adapter, remove=name)

    # -- lifetime --------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            if self.process.is_alive():
                self._outbound.send(wire.encode(wire.Shutdown()))
        self._stop_process()
        self._reader.join(timeout=5)
        self._handle.close()

    def _wait_until_ready(self, cancel: threading.Event | None) -> wire.EngineInfo:
        while True:
            if cancel is not None and cancel.is_set():
                raise StartCancelled("the server is stopping")
            if self._inbound.poll(READY_POLL_MS):
                message = wire.decode(self._inbound.recv())
                if isinstance(message, wire.Ready):
                    return message.info
                if isinstance(message, wire.StartFailed):
                    raise ValueError(message.reason)
            elif not self.process.is_alive():
                raise RuntimeError(f"the engine process exited while loading the model (code {self.process.exitcode})")

    def _stop_process(self) -> None:
        self._handle.end_process(SHUTDOWN_TIMEOUT_S if self._stopping else 0)

    # -- the reader thread -----------------------------------------------------------------------------
    def _read(self) -> None:
        poller = zmq.Poller()
        poller.register(self._inbound, zmq.POLLIN)
        poller.register(self.process.sentinel, zmq.POLLIN)
        while True:
            events = dict(poller.poll())
            if self._inbound in events:
                self._drain()
            if self.process.sentinel in events:
                self._drain()  # its last words (Died) may have arrived with its exit
                self.process.join(1)  # reaped, so that its exit code is known
                if not self._stopping:
                    self._die(f"the engine process exited (code {self.process.exitcode})")
                return

    def _drain(self) -> None:
        while True:
            try:
                message = wire.decode(self._inbound.recv(zmq.NOBLOCK))
            except zmq.Again:
                return
            if isinstance(message, wire.Updates):
                for number, item in message.items:
                    mailbox = self._mailboxes.get(number)
                    if mailbox is not None:  # else its call has ended and been collected
                        mailbox.post(item)
            elif isinstance(message, wire.MetricsText | wire.AdapterChanged):
                waiting = self._answers.get(message.query)
                if waiting is not None:
                    waiting[1].append(message)
                    waiting[0].set()
            elif isinstance(message, wire.Died):
                self._die(f"the engine loop died ({message.reason})")

    def _die(self, reason: str) -> None:
        with self._lock:
            if self.dead is not None:
                return
            self.dead = EngineProcessDied(reason)
        logger.critical("%s; failing every request", reason)
        error = EngineDeadError("the engine has stopped after an internal error")
        for mailbox in list(self._mailboxes.values()):
            mailbox.post(error)
        for done, _ in list(self._answers.values()):
            done.set()
        if self.on_death is not None:
            self.on_death(self.dead)


class EngineMetricsCollector:
    """The engine process's metrics inside the API server's registry, fetched at each scrape. Admission
    is counted on this side (server/metrics.track_admission); the engine's registry has none."""

    def __init__(self, fetch: Callable[[], str]) -> None:
        self._fetch = fetch

    def collect(self) -> Iterator[Metric]:
        yield from text_string_to_metric_families(self._fetch())
