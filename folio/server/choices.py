"""Runs the engine requests behind one API call (n choices x prompts) and merges their updates.

Each choice is its own engine request; updates are interleaved in arrival order. Leaving the merged
stream early (client gone, error) cancels every choice, which aborts it in the engine and frees its
KV blocks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from folio.engine.async_engine import RequestUpdate
from folio.outputs import TokenLogprob


@dataclass
class ChoiceResult:
    """A finished choice, accumulated from its updates (the non-streaming responses use this)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0

    def add(self, update: RequestUpdate) -> None:
        self.text += update.text
        self.token_ids.extend(update.new_token_ids)
        self.logprobs.extend(update.new_logprobs)
        self.num_prompt_tokens = update.num_prompt_tokens
        if update.finished:
            self.finish_reason = update.finish_reason


_DONE = object()


async def merge_updates(streams: list[AsyncIterator[RequestUpdate]]) -> AsyncIterator[tuple[int, RequestUpdate]]:
    """Yield (choice index, update) from all streams as they arrive."""
    if len(streams) == 1:
        try:
            async for update in streams[0]:
                yield 0, update
        finally:
            await streams[0].aclose()  # type: ignore[attr-defined]  # aborts the request if unfinished
        return
    inbox: asyncio.Queue[tuple[int, RequestUpdate | BaseException | object]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[RequestUpdate]) -> None:
        try:
            async for update in stream:
                inbox.put_nowait((index, update))
        except Exception as exc:
            inbox.put_nowait((index, exc))
        inbox.put_nowait((index, _DONE))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await inbox.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item  # type: ignore[misc]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect(streams: list[AsyncIterator[RequestUpdate]]) -> list[ChoiceResult]:
    results = [ChoiceResult() for _ in streams]
    async for index, update in merge_updates(streams):
        results[index].add(update)
    return results
