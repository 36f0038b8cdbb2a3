"""Ties an API call's engine work to its HTTP exchange: it stops when the client hangs up, and what it
holds (engine requests, admission slots) is given back however the exchange ends.

Starlette notices a client that hung up only when it writes to it, so a non-streaming request would
otherwise generate to its end for nobody: `cancel_on_disconnect` runs the handler beside a listener for
`http.disconnect` and cancels the handler when it arrives. A streaming response's cleanup runs in
`ClosingStreamingResponse.__call__`'s finally: Starlette always calls the response, while a body
generator that was never started never runs its own finally.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, Callable, Coroutine
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from folio.server.answer_body import json_answer

CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left; it is never delivered, only logged


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(request: Request, handler: Coroutine[Any, Any, Any]) -> Response:
    """Run `handler`; if the client disconnects first, cancel it (its finally blocks abort the engine
    requests) and answer 499 to nobody. An answer that is not a Response yet is written as JSON off the
    event loop (answer_body.py)."""
    work = asyncio.ensure_future(handler)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
    if not work.done() or work.cancelled():
        # cancel() only asks: the handler unwinds (and gives back what it held) when awaited here
        await asyncio.gather(work, return_exceptions=True)
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    answer = work.result()
    return answer if isinstance(answer, Response) else await json_answer(answer)


class ClosingStreamingResponse(StreamingResponse):
    """A streaming response that calls `on_close` once it ends, whether the stream ran out, failed, the
    client left, or the body iterator never started."""

    def __init__(
        self, content: AsyncIterable[str], on_close: Callable[[], None], media_type: str = "text/event-stream"
    ) -> None:
        super().__init__(content, media_type=media_type)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()  # synchronous, so a cancelled task cannot skip it
