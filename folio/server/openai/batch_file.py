"""OpenAI's batch-file format, run against folio's own app in this process (`folio run-batch`, as
`vllm run-batch`): each input line `{"custom_id", "method", "url", "body"}` becomes one request to the
route it names, sent through the ASGI app itself, so validation, errors and outputs are the server's.
Requests run concurrently, so the engine batches them; output lines keep the input's order.

An answered request gives `{"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error": null}` (a 4xx too, with the API's error body); a line that is not a request at all, or one that
fails on its way, gives `"response": null` and an `error`. Every input line gives exactly one output
line, whatever it holds: one bad line never costs the others their answers (as OpenAI's batch API)."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI

BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
BUSY_RETRY_S = 0.05  # a 429 means the server is full for now: the request waits and goes again
JSON_HEADERS = {"content-type": "application/json"}
# Raw in JSON strings but line breaks to str.splitlines and many JSONL readers: written escaped instead.
LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})

logger = logging.getLogger("folio")


@dataclass
class BatchSummary:
    requests: int = 0
    answered_ok: int = 0  # 2xx
    answered_error: int = 0  # 4xx/5xx answers
    invalid_lines: int = 0
    failed: int = 0  # requests that broke on their way (an error line each; the others still ran)


@dataclass(frozen=True)
class BatchRequest:
    custom_id: str
    url: str
    content: str  # the body as JSON text, exactly as the app will read it


def batch_lines(data: bytes) -> list[str]:
    """The non-blank lines of a batch file. Split on newlines only (JSON allows a raw U+2028 inside a string,
    which str.splitlines would cut); bytes that are not UTF-8 stay as lone surrogates, so that line alone
    is refused rather than the whole file."""
    text = data.decode("utf-8", errors="surrogateescape")
    return [line.removesuffix("\r") for line in text.split("\n") if line.strip()]


def output_line(output: dict[str, Any]) -> str:
    """One output line as strict JSON text that every reader sees as one line. A string holding a lone
    surrogate cannot be written as UTF-8, so such a line is written with ASCII escapes (the same value)."""
    text = json.dumps(output, ensure_ascii=False, allow_nan=False).translate(LINE_BREAKS)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(output, allow_nan=False)
    return text


def _line_error(custom_id: Any, code: str, message: str) -> dict[str, Any]:
    custom_id = custom_id if isinstance(custom_id, str) else None  # echo only what could be an id
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}  # fmt: skip


def _request(line: str, number: int) -> tuple[BatchRequest | None, dict[str, Any] | None]:
    """(the request, None) or (None, the line's error output)."""
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:
        return None, _line_error(None, "invalid_json", f"line {number} is not UTF-8 text")
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        return None, _line_error(None, "invalid_json", f"line {number} is not JSON: {exc.msg}")
    except RecursionError:
        return None, _line_error(None, "invalid_json", f"line {number} is nested too deeply to read")
    except ValueError as exc:  # e.g. an integer too long to read
        return None, _line_error(None, "invalid_json", f"line {number} cannot be read: {exc}")
    if not isinstance(record, dict):
        return None, _line_error(None, "invalid_request", f"line {number} is not a JSON object")
    custom_id = record.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return None, _line_error(custom_id, "missing_custom_id", f"line {number} has no custom_id")
    if record.get("method", "POST") != "POST":
        return None, _line_error(custom_id, "invalid_method", f"line {number}: only POST requests can be batched")
    url = record.get("url")
    if url not in BATCH_URLS:
        return None, _line_error(custom_id, "invalid_url", f"line {number}: url must be one of {', '.join(BATCH_URLS)}")
    body = record.get("body")
    if not isinstance(body, dict):
        return None, _line_error(custom_id, "invalid_request", f"line {number}: body must be a JSON object")
    if body.get("stream"):
        return None, _line_error(custom_id, "invalid_request", f"line {number}: batch requests cannot stream")
    try:
        # ASCII escapes keep a lone surrogate a string, and NaN stays NaN: the server's own validation
        # answers either in the API's error format, as it would over HTTP.
        content = json.dumps(body)
    except (ValueError, RecursionError) as exc:
        return None, _line_error(custom_id, "invalid_request", f"line {number}: body cannot be sent: {exc}")
    return BatchRequest(custom_id, url, content), None


async def run_batch(
    app: FastAPI, lines: list[str], concurrency: int, on_done: Callable[[], None] = lambda: None
) -> tuple[list[str], BatchSummary]:
    """Every line's output as a line of JSON text, in order, and the counts."""
    summary = BatchSummary(requests=len(lines))
    gate = asyncio.Semaphore(concurrency)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://folio-batch", timeout=None) as client:

        async def answer(number: int, line: str) -> str:
            request, error = _request(line, number)
            if request is None:
                summary.invalid_lines += 1
                return output_line(error)  # type: ignore[arg-type]
            try:
                async with gate:
                    while (response := await client.post(request.url, content=request.content,
                                                         headers=JSON_HEADERS)).status_code == 429:  # fmt: skip
                        await asyncio.sleep(BUSY_RETRY_S)
                text = output_line({"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": request.custom_id,
                                    "response": {"status_code": response.status_code,
                                                 "request_id": f"req_{uuid.uuid4().hex}", "body": response.json()},
                                    "error": None})  # fmt: skip
            except Exception as exc:  # one request's fault ends that request, never the batch
                logger.warning("batch line %d (%s) failed: %s: %s", number, request.custom_id, type(exc).__name__, exc)
                summary.failed += 1
                return output_line(_line_error(request.custom_id, "request_failed",
                                               f"line {number}: the request failed: {type(exc).__name__}"))  # fmt: skip
            if response.is_success:
                summary.answered_ok += 1
            else:
                summary.answered_error += 1
            return text

        async def one(number: int, line: str) -> str:
            try:
                return await answer(number, line)
            except Exception as exc:  # a bug reading the line itself: still its own error line
                logger.warning("batch line %d failed: %s: %s", number, type(exc).__name__, exc)
                summary.failed += 1
                return output_line(_line_error(None, "request_failed", f"line {number} failed: {type(exc).__name__}"))
            finally:
                on_done()

        outputs = await asyncio.gather(*(one(number, line) for number, line in enumerate(lines, start=1)))
    return list(outputs), summary
