"""What comes back from the engine for one request, and how it gets to the API call waiting for it.

The engine loop posts each request's updates to that request's mailbox. In this process a mailbox is
an asyncio queue on the caller's event loop (`LoopMailbox`); across processes it is an entry of the
next batch sent over the wire (server/engine_client/process_main.py). Either way the caller reads the same items:
(choice index, RequestUpdate), or an exception that ends the whole call.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from folio.engine.request import Request
from folio.outputs import TokenLogprob


class EngineDeadError(RuntimeError):
    """The engine has stopped: nothing runs until the process restarts."""


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
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (known once scheduled)


@dataclass
class ChoiceResult:
    """A finished choice, accumulated from its updates (the non-streaming responses use this)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # if asked for, from the request's first update
    stop_reason: str | None = None  # the stop string that ended it
    num_cached_tokens: int = 0  # of its prompt, tokens found in the prefix cache

    def add(self, update: RequestUpdate) -> None:
        self.num_cached_tokens = max(self.num_cached_tokens, update.num_cached_tokens)
        if update.prompt_logprobs is not None:
            self.prompt_logprobs = update.prompt_logprobs
        self.text += update.text
        self.token_ids.extend(update.new_token_ids)
        self.logprobs.extend(update.new_logprobs)
        if update.finished:
            self.finish_reason = update.finish_reason
            self.stop_reason = update.stop_reason


Update = tuple[int, RequestUpdate] | BaseException  # one item of an API call's updates


class Mailbox(Protocol):
    """Where the engine loop posts one API call's updates; called on the engine's thread."""

    def post(self, item: Update) -> None: ...


@dataclass(eq=False)  # identity: hashable, and held weakly by the process client
class LoopMailbox:
    """An API call's updates on its own event loop's queue. The engine holds this, not the call's
    Generation, so a Generation nobody holds any more is collected, and its __del__ aborts its requests."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Update] = field(default_factory=asyncio.Queue)

    def post(self, item: Update) -> None:
        """Thread-safe. A closed event loop means nobody is listening any more."""
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


@dataclass
class Stream:
    """One engine request of an API call: where its updates go, and which choice it answers."""

    request: Request
    mailbox: Mailbox
    index: int


def take_update(
    item: Update, close: Callable[[], None], finished: Callable[[int], object]
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
