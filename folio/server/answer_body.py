"""A whole (non-streamed) answer's JSON, written on a worker thread in pieces.

FastAPI turns a returned dict into JSON on the event loop, through `jsonable_encoder`: 3.3 s for the
answer to 2,048 embedding inputs of 576 dimensions, during which /health and every stream wait. Moving
the work to a thread is not enough alone: `json.dumps` holds the GIL for its whole call (0.7 s for that
answer), so the loop would still wait. `json_pieces` calls it on pieces instead (each vector, each choice),
and between two pieces the interpreter can hand the GIL to the event loop.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

_dumps = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode  # as JSONResponse


def _holds_containers(value: dict | list) -> bool:
    return any(isinstance(item, dict | list) for item in (value.values() if isinstance(value, dict) else value))


def json_pieces(value: Any) -> Iterator[str]:
    """`value` as JSON text, one piece per container of containers; a container of scalars (a vector, a
    list of token ids) is one piece."""
    if not isinstance(value, dict | list) or not _holds_containers(value):
        yield _dumps(value)
    elif isinstance(value, dict):
        yield "{"
        for index, (key, item) in enumerate(value.items()):
            yield ("," if index else "") + _dumps({key: None})[1:-6] + ":"  # '{"k":null}': json's own key text
            yield from json_pieces(item)
        yield "}"
    else:
        yield "["
        for index, item in enumerate(value):
            if index:
                yield ","
            yield from json_pieces(item)
        yield "]"


def _encoded(value: Any) -> bytes:
    return "".join(json_pieces(value)).encode()


async def json_answer(value: Any) -> Response:
    """A JSON response whose body was written off the event loop (FastAPI passes a Response through as is)."""
    return Response(await run_in_threadpool(_encoded, value), media_type="application/json")
