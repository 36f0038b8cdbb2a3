"""OpenAI's batch-file format, run against folio's own app in this process (`folio run-batch`, as
`vllm run-batch`): each input line `{"custom_id", "method", "url", "body"}` becomes one request to the
route it names, sent through the ASGI app itself, so validation, errors and outputs are the server's.
Requests run concurrently, so the engine batches them; output lines keep the input's order.

An answered request gives `{"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error": null}` (a 4xx too, with the API's error body); a line that is not a request at all gives
`"response": null` and an `error`."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI

BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
BUSY_RETRY_S = 0.05  # a 429 means the server is full for now: the request waits and goes again


@dataclass
class BatchSummary:
    requests: int = 0
    answered_ok: int = 0  # 2xx
    answered_error: int = 0  # 4xx/5xx answers
    invalid_lines: int = 0


def _line_error(custom_id: Any, code: str, message: str) -> dict[str, Any]:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}  # fmt: skip


def _request(line: str, number: int) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(the request, None) or (None, the line's error output)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        return None, _line_error(None, "invalid_json", f"line {number} is not JSON: {exc.msg}")
    if not isinstance(record, dict):
        return None, _line_error(None, "invalid_request", f"line {number} is not a JSON object")
    custom_id = record.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return None, _line_error(custom_id, "missing_custom_id", f"line {number} has no custom_id")
    if record.get("method", "POST") != "POST":
        return None, _line_error(custom_id, "invalid_method", f"line {number}: only POST requests can be batched")
    if record.get("url") not in BATCH_URLS:
        return None, _line_error(custom_id, "invalid_url", f"line {number}: url must be one of {', '.join(BATCH_URLS)}")
    body = record.get("body")
    if not isinstance(body, dict):
        return None, _line_error(custom_id, "invalid_request", f"line {number}: body must be a JSON object")
    if body.get("stream"):
        return None, _line_error(custom_id, "invalid_request", f"line {number}: batch requests cannot stream")
    return record, None


async def run_batch(
    app: FastAPI, lines: list[str], concurrency: int, on_done: Callable[[], None] = lambda: None
) -> tuple[list[dict[str, Any]], BatchSummary]:
    """Every line's output, in order, and the counts."""
    summary = BatchSummary(requests=len(lines))
    gate = asyncio.Semaphore(concurrency)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://folio-batch", timeout=None) as client:

        async def one(number: int, line: str) -> dict[str, Any]:
            request, error = _request(line, number)
            if request is None:
                summary.invalid_lines += 1
                on_done()
                return error  # type: ignore[return-value]
            async with gate:
                while (response := await client.post(request["url"], json=request["body"])).status_code == 429:
                    await asyncio.sleep(BUSY_RETRY_S)
            if response.is_success:
                summary.answered_ok += 1
            else:
                summary.answered_error += 1
            on_done()
            return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": request["custom_id"],
                    "response": {"status_code": response.status_code, "request_id": f"req_{uuid.uuid4().hex}",
                                 "body": response.json()}, "error": None}  # fmt: skip

        outputs = await asyncio.gather(*(one(number, line) for number, line in enumerate(lines, start=1)))
    return list(outputs), summary
