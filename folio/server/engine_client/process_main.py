"""The engine's side of `folio serve --engine-process`: a process that loads the model and runs the
engine loop, so the API server's Python (HTTP, JSON, SSE, tokenizing) never holds this loop's GIL.

The loop is `AsyncEngine`'s, unchanged: its faults, aborts and detokenizing work as in one process.
Only the mailboxes differ: each API call's updates are queued in a `WireOutbox`, which sends what a
round of the loop posted as one message. This process's main thread only receives: requests,
aborts and LoRA adapter changes go to the loop's inbox, metrics scrapes are answered from the engine's
own registry.

It stops on `Shutdown`, and on its own when the API server's process has gone (the parent's pid
changed), so a killed server never leaves a model loaded behind it.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

import zmq
from prometheus_client import generate_latest

from folio.engine.engine_core import EngineCore
from folio.server.engine_client import wire
from folio.server.engine_client.thread import AsyncEngine
from folio.server.engine_client.updates import EngineDeadError, Stream, Update
from folio.server.metrics import ServerMetrics

logger = logging.getLogger("folio")

PARENT_CHECK_MS = 1000  # how often an idle engine looks whether the API server is still there
LINGER_MS = 1000  # how long closing waits for unsent messages


class WireOutbox:
    """Updates posted on the engine thread (and refusals on the main thread), sent in batches."""

    def __init__(self, socket: zmq.Socket) -> None:
        self._socket = socket
        self._lock = threading.Lock()  # a ZeroMQ socket is not thread-safe: one user at a time
        self._pending: list[tuple[int, Update]] = []

    def post(self, mailbox: int, item: Update) -> None:
        with self._lock:
            self._pending.append((mailbox, item))

    def flush(self) -> None:
        with self._lock:
            if self._pending:
                batch, self._pending = self._pending, []
                self._socket.send(wire.encode(wire.Updates(batch)))

    def send(self, message: object) -> None:
        with self._lock:
            self._socket.send(wire.encode(message))


class WireMailbox:
    """One API call's mailbox on the far side of the wire."""

    def __init__(self, mailbox: int, outbox: WireOutbox) -> None:
        self._mailbox = mailbox
        self._outbox = outbox

    def post(self, item: Update) -> None:
        self._outbox.post(self._mailbox, item)


def run_engine_process(to_engine: str, from_engine: str, log_level: int) -> None:
    """The process's target: wait for its model (imports done, so that a load started ahead costs only
    the load), load it, say Ready (or StartFailed), serve until Shutdown or orphaned."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches the server, which stops us
    logging.basicConfig(level=logging.WARNING, format="folio: %(message)s", stream=sys.stderr)
    logger.setLevel(log_level)
    parent = os.getppid()
    context = zmq.Context()
    inbound, outbound = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    inbound.connect(to_engine)
    outbound.connect(from_engine)
    outbox = WireOutbox(outbound)
    try:
        load = _wait_for_load(inbound, parent)
        if load is None:
            return
        try:
            core = EngineCore.from_engine_args(load.args)
        except Exception as exc:  # a bad model or flag: the server reports it as one line
            outbox.send(wire.StartFailed(str(exc) or type(exc).__name__))
            return
        metrics = ServerMetrics(core, load.model_name)
        engine = AsyncEngine(
            core, core.tokenizer, frozenset(core.model_config.eos_token_ids), observer=metrics,
            on_death=lambda exc: outbox.send(wire.Died(f"{type(exc).__name__}: {exc}")), flush=outbox.flush,
        )  # fmt: skip
        outbox.send(wire.Ready(wire.EngineInfo.of(core, load.model_name, load.send_tokenizer)))
        try:
            _receive(inbound, engine, outbox, metrics, parent)
        finally:
            engine.shutdown()
    finally:
        inbound.close(linger=0)
        outbound.close(linger=LINGER_MS)
        context.term()


def _wait_for_load(inbound: zmq.Socket, parent: int) -> wire.Load | None:
    """The Load message; None if the server goes (or says Shutdown) first."""
    poller = zmq.Poller()
    poller.register(inbound, zmq.POLLIN)
    while True:
        if not poller.poll(PARENT_CHECK_MS):
            if os.getppid() != parent:
                return None
            continue
        message = wire.decode(inbound.recv())
        if isinstance(message, wire.Load):
            return message
        if isinstance(message, wire.Shutdown):
            return None


def _receive(inbound: zmq.Socket, engine: AsyncEngine, outbox: WireOutbox, metrics: ServerMetrics, parent: int) -> None:
    poller = zmq.Poller()
    poller.register(inbound, zmq.POLLIN)
    while True:
        if not poller.poll(PARENT_CHECK_MS):
            if os.getppid() != parent:
                logger.warning("the API server has gone; the engine process stops")
                return
            continue
        message = wire.decode(inbound.recv())
        if isinstance(message, wire.Submit):
            mailbox = WireMailbox(message.mailbox, outbox)
            streams = [Stream(r, mailbox, message.first_index + i) for i, r in enumerate(message.requests)]
            try:
                engine.submit(streams)
            except EngineDeadError as exc:
                outbox.post(message.mailbox, exc)
                outbox.flush()
        elif isinstance(message, wire.Abort):
            engine.abort(message.request_id)
        elif isinstance(message, wire.AdapterChange):
            _change_adapter(engine, outbox, message)
        elif isinstance(message, wire.MetricsQuery):
            outbox.send(wire.MetricsText(message.query, generate_latest(metrics.registry).decode()))
        elif isinstance(message, wire.Shutdown):
            return


def _change_adapter(engine: AsyncEngine, outbox: WireOutbox, change: wire.AdapterChange) -> None:
    """Made on the engine thread between two steps, as in one process; answered from there."""

    def apply(core: EngineCore) -> bool:
        if change.add is not None:
            core.add_lora(change.add)
            return False
        return core.remove_lora(change.remove or "")

    def reply(removed: object, error: Exception | None) -> None:
        text = None if error is None else str(error) or type(error).__name__
        outbox.send(wire.AdapterChanged(change.query, bool(removed), text, isinstance(error, ValueError)))

    try:
        engine.call_then(apply, reply)
    except EngineDeadError as exc:
        reply(False, exc)
