"""Every route's JSON body is parsed and validated here, the large ones on a worker thread.

FastAPI reads a route's JSON body and validates it against the route's model inline, on the loop that
also answers /health and writes every stream. For a body of a few MiB that is tens to hundreds of
milliseconds (json.loads, RequestBody's walk, pydantic), during which no other request moves. A route of
`OffLoopBodyRoute` parses and validates the body itself, with `run_in_threadpool` for bodies over
`OFF_LOOP_BYTES`, then hands FastAPI the validated model: pydantic does not validate a model instance
again, so FastAPI's own pass costs nothing. Small bodies go the same way on the loop, so a body gets the
same answer whatever its size (FastAPI's own reading answers a body nested past json's recursion limit
with a bare "There was an error parsing the body").

A thread does not free the loop from json.loads, though: it holds the GIL for its whole call (~50 ms for a
body of a million one-character prompts). So a large body's bytes are first scanned by the json_shape
kernel (csrc/json_shape.cpp), without the GIL and without building anything, and a body that breaks
RequestBody's rules on depth, entries, NaN or surrogates is refused from the scan alone. The kernel is built
on a thread when the app is made (`warm_json_scanner`); until it is there, large bodies go the slow way.
"""

from __future__ import annotations

import email.message
import json
import threading
from collections.abc import Callable, Coroutine
from types import ModuleType
from typing import Any

import torch
from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool

from folio import ops
from folio.server.request_body import BODY_FAULTS, MAX_JSON_DEPTH, MAX_JSON_ITEMS, body_fault

OFF_LOOP_BYTES = 64 * 1024  # below this, parsing and validating takes well under a millisecond


def _is_json(request: Request) -> bool:
    """Whether FastAPI would read this body as JSON (as fastapi.routing does: no content type, or a JSON one)."""
    content_type = request.headers.get("content-type")
    if not content_type:
        return True
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


class _Scanner:
    """The json_shape kernel once loaded; None before (or where it cannot be built)."""

    module: ModuleType | None = None
    started = False
    lock = threading.Lock()


def warm_json_scanner() -> None:
    """Load (building it if need be) the json_shape kernel on a thread of its own, once per process."""
    with _Scanner.lock:
        if _Scanner.started:
            return
        _Scanner.started = True

    def load() -> None:
        _Scanner.module = ops.load("json_shape")

    threading.Thread(target=load, name="folio-json-scanner", daemon=True).start()


def _scan(body: bytes) -> None:
    """Raise the RequestValidationError of the first fault the kernel finds in `body`'s bytes, if it is loaded."""
    scanner = _Scanner.module
    if scanner is None:
        return
    kind, _, path = scanner.scan_json(torch.frombuffer(bytearray(body), dtype=torch.uint8), MAX_JSON_DEPTH,
                                      MAX_JSON_ITEMS)  # fmt: skip
    if kind:
        fault = body_fault(BODY_FAULTS[kind - 1], path or "body")
        raise RequestValidationError([{"type": fault.type, "loc": ("body",), "msg": fault.message(),
                                       "input": {}, "ctx": fault.context}])  # fmt: skip


def parse_and_validate(model: type[BaseModel], body: bytes) -> BaseModel:
    """The body as `model`, or the RequestValidationError FastAPI would have raised (locations under "body")."""
    if len(body) > OFF_LOOP_BYTES:
        _scan(body)
    try:
        data = json.loads(body)
    except json.JSONDecodeError as exc:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": exc.msg}}]) from None  # fmt: skip
    except (ValueError, RecursionError) as exc:  # not UTF-8; nested past json's recursion limit
        reason = "it is nested too deeply to read" if isinstance(exc, RecursionError) else str(exc)
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body",), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": reason}}]) from None  # fmt: skip
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False)
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in errors]) from None


class OffLoopBodyRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()
        model = self.body_field.field_info.annotation if self.body_field is not None else None
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return handle

        async def handler(request: Request) -> Response:
            body = await request.body()
            if body and _is_json(request):  # an empty body is FastAPI's to refuse ("field required")
                if len(body) > OFF_LOOP_BYTES:
                    validated = await run_in_threadpool(parse_and_validate, model, body)
                else:
                    validated = parse_and_validate(model, body)
                # FastAPI takes the body from request.json(), which returns Starlette's cached `_json`.
                request._json = validated
            return await handle(request)

        return handler
