"""Server-sent events as OpenAI streams them: `data: {json}` per chunk, then `data: [DONE]`; and the guard
every streamed answer (of any API) runs inside."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable

from folio.server.engine_client.updates import EngineDeadError, RequestFailedError
from folio.server.errors import APIError, error_body, error_for

logger = logging.getLogger("folio")

DONE = "data: [DONE]\n\n"


def event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; `cached_tokens`: prompt tokens whose KV came from the prefix cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def openai_error_event(error: APIError) -> str:
    return event(error_body(error.status, error.message, error.param, error.code)) + DONE


async def guarded(
    events: AsyncIterator[str], error_event: Callable[[APIError], str] = openai_error_event
) -> AsyncIterator[str]:
    """Relay a response's events. A failure after the 200 (the status line is already sent) becomes the
    API's own error event (`error_event`; OpenAI's: an error event followed by `[DONE]`), so every
    stream ends the way its clients expect."""
    try:
        async for item in events:
            yield item
    except Exception as exc:
        error = error_for(exc)
        if error.status >= 500:
            logger.error("stream failed: %s", exc, exc_info=not isinstance(exc, EngineDeadError | RequestFailedError))
        yield error_event(error)
