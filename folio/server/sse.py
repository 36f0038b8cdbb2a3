"""Server-sent events as OpenAI streams them: `data: {json}` per chunk, then `data: [DONE]`."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable

from folio.server.errors import error_body

logger = logging.getLogger("folio")

DONE = "data: [DONE]\n\n"


def event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


async def guarded(events: AsyncIterator[str], release: Callable[[], None]) -> AsyncIterator[str]:
    """Relay a response's events; an engine failure mid-stream becomes an error event (the status line
    is already sent). `release` runs however the stream ends, client disconnects included."""
    try:
        async for item in events:
            yield item
    except RuntimeError as exc:
        logger.error("stream failed: %s", exc)
        yield event(error_body(500, str(exc)))
    finally:
        await events.aclose()  # type: ignore[attr-defined]
        release()
