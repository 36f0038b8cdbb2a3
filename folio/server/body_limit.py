"""Refuses request bodies over the size limit with a 413 in OpenAI's error format: at once when the
Content-Length announces it, else as soon as the chunks received pass it (the handler's body read
raises, and the app's HTTPException handler answers). Starlette's own RequestBodyLimitMiddleware does
the same counting but always answers in plain text, which OpenAI clients cannot parse."""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from folio.server.errors import APIError, error_response


def too_large_message(max_body_bytes: int) -> str:
    return f"the request body is larger than {max_body_bytes} bytes (--max-request-bytes)"


BLOBS_PATH = "/api/blobs/"  # Ollama's file uploads: streamed to disk under their own limit, never parsed


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"].startswith(BLOBS_PATH):
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            refusal = error_response(APIError(413, too_large_message(self.max_body_bytes)), scope["path"])
            await refusal(scope, receive, send)
            return
        received = 0

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise HTTPException(413)
            return message

        await self.app(scope, counted_receive, send)
