"""`--api-key`: every route but /health (and the web pages' static files, folio/server/ui) needs
`Authorization: Bearer <key>` (or Anthropic's `x-api-key: <key>`), else 401.

The server keeps only a salted SHA-256 of the key (`APIKeyDigest`): under `--replicas` the ingress's
arguments travel through Ray, whose dashboard and state API show them, so the key itself must not.

A plain ASGI middleware rather than Starlette's BaseHTTPMiddleware, so streaming responses and client
disconnects pass through untouched.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

from starlette.types import ASGIApp, Receive, Scope, Send

from folio.server.errors import APIError, error_response
from folio.server.ui.routes import is_ui_path

OPEN_PATHS = frozenset({"/health"})
BEARER = b"Bearer "


@dataclass(frozen=True)
class APIKeyDigest:
    """sha256(salt + key) with a random 16-byte salt: enough to check a presented key, not to present one."""

    salt: bytes
    sha256: bytes

    @classmethod
    def of(cls, key: str) -> APIKeyDigest:
        if not key.strip():
            raise ValueError("the API key is empty")
        salt = secrets.token_bytes(16)
        return cls(salt, hashlib.sha256(salt + key.encode()).digest())

    def matches(self, presented: bytes) -> bool:
        # Compare digests, not keys: the time taken tells nothing about how much of the key was right.
        return hmac.compare_digest(hashlib.sha256(self.salt + presented).digest(), self.sha256)

    def __repr__(self) -> str:  # the digest still lets a weak key be guessed offline: keep it out of logs
        return "APIKeyDigest(<salted sha256>)"


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str | APIKeyDigest, open_ui: bool = False) -> None:
        self.app = app
        self._digest = api_key if isinstance(api_key, APIKeyDigest) else APIKeyDigest.of(api_key)
        self._open_ui = open_ui  # the pages load without the key and ask for it

    def _is_open(self, scope: Scope) -> bool:
        path = scope["path"]
        return path in OPEN_PATHS or (self._open_ui and scope["method"] in ("GET", "HEAD") and is_ui_path(path))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._is_open(scope):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        given = headers.get(b"authorization", b"")
        bearer = given.startswith(BEARER) and self._digest.matches(given[len(BEARER) :])
        if bearer or (b"x-api-key" in headers and self._digest.matches(headers[b"x-api-key"])):
            await self.app(scope, receive, send)
            return
        message = "missing API key: send 'Authorization: Bearer <key>'" if not given else "incorrect API key"
        error = APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await error_response(error, scope["path"])(scope, receive, send)
