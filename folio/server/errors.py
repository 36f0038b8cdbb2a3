"""Errors in each API's own format, with a 4xx/5xx status: OpenAI's `{"error": {"message", "type",
"param", "code"}}` (also for the Responses API), Ollama's `{"error": "message"}` under /api/, and
Anthropic's `{"type": "error", "error": {"type", "message"}}` under /v1/messages."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from fastapi.responses import JSONResponse

from folio.server.engine_client.updates import EngineDeadError, RequestFailedError

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}  # fmt: skip

# What a 500 says: the exception's own text stays in the server's log (it can hold paths, values or
# library internals a client should not see).
INTERNAL_ERROR = "the server failed to process this request; the error is in the server's log"


@dataclass(eq=False)  # compared by identity, as exceptions are
class APIError(Exception):
    """Raised anywhere in a request handler; the app turns it into an error response in the API's format."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)


def error_for(exc: BaseException) -> APIError:
    """The error a client sees for a failure after its request was accepted (kept to words we wrote)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), code="engine_dead")
    if isinstance(exc, RequestFailedError):
        return APIError(500, f"this request failed inside the engine: {exc}", code="request_failed")
    if isinstance(exc, ValueError):  # the engine refused the request's own parameters
        return APIError(400, str(exc))
    return APIError(500, INTERNAL_ERROR)


@contextlib.contextmanager
def engine_errors() -> Iterator[None]:
    """Around waiting for an accepted request's engine work: its failures become the client's errors."""
    try:
        yield
    except (EngineDeadError, RequestFailedError, ValueError) as exc:
        raise error_for(exc) from exc


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = _TYPES.get(status, "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                    413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}  # fmt: skip


def error_body_for(path: str, status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """The error body of the API that `path` belongs to."""
    if path.startswith("/api/"):
        return {"error": message}
    if path.startswith("/v1/messages"):
        return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}
    return error_body(status, message, param, code)


def error_response(error: APIError, path: str = "") -> JSONResponse:
    return JSONResponse(
        status_code=error.status,
        content=error_body_for(path, error.status, error.message, error.param, error.code),
        headers=error.headers,
    )
