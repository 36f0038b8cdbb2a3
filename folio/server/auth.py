"""`--api-key`: every route but /health needs `Authorization: Bearer <key>` (or Anthropic's
`x-api-key: <key>`), else 401.

A plain ASGI middleware rather than Starlette's BaseHTTPMiddleware, so streaming responses and client
disconnects pass through untouched.
"""

from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from folio.server.errors import error_body_for

OPEN_PATHS = frozenset({"/health"})


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        given = headers.get(b"authorization", b"")
        if hmac.compare_digest(given, self._expected) or hmac.compare_digest(headers.get(b"x-api-key", b""), self._key):
            await self.app(scope, receive, send)
            return
        message = "missing API key: send 'Authorization: Bearer <key>'" if not given else "incorrect API key"
        body = error_body_for(scope["path"], 401, message, code="invalid_api_key")
        await JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
