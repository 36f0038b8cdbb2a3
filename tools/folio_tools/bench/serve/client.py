"""The client side of `folio bench serve`: streamed OpenAI-style requests sent on a Poisson schedule.

Each request is one `httpx` stream; the SSE `data: ...` lines are parsed here so that every chunk gets
its own arrival time. A failed request (refused, non-200, broken or cut-off stream) becomes a record
with its error, never an exception out of the run.

Connections are never reused: every request goes out on a new one and asks the server to close it
(`Connection: close`, and no keep-alive pool on our side). llama.cpp's llama-server sometimes drops the
next request sent on a kept-alive connection after a streamed response ("Server disconnected", about one
in ten), which would count as a server failure that no user of a fresh connection sees. A connection per
request costs one TCP handshake, the same on every server, so it is part of TTFT and end-to-end latency
for all of them alike and does not bias the comparison.

`Target.extra_body` is merged into every request body, e.g. {"cache_prompt": false} so that llama-server
does not reuse the KV cache of an earlier prompt (its default) while a server without a prefix cache
cannot. Keys that the benchmark itself depends on (`RESERVED_KEYS`) cannot be set that way.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from tqdm import tqdm

from folio_tools.bench.serve.stats import RequestRecord, format_rate

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
# Set by request_body and needed to measure what is meant: one streamed choice of exactly output_len tokens.
RESERVED_KEYS = frozenset(
    ("model", "prompt", "messages", "max_tokens", "max_completion_tokens", "n", "stream", "stream_options")
)


@dataclass(frozen=True)
class ServeRequest:
    prompt: str  # the text prompt, or for chat the user's message
    prompt_len: int
    output_len: int
    messages: list[dict[str, Any]] | None = None  # chat: the whole history to send, else one user message
    conversation: int | None = None  # multi-turn: its requests go out one after another, in list order
    turn: int | None = None


@dataclass(frozen=True)
class Target:
    base_url: str  # without the trailing /v1
    model: str
    chat: bool  # /v1/chat/completions with messages, else /v1/completions with a text prompt
    include_usage: bool = True  # ask for the final usage chunk (stream_options)
    timeout_s: float = 600.0
    extra_body: Mapping[str, Any] = field(default_factory=dict)  # merged into every request body

    @property
    def url(self) -> str:
        return self.base_url + (CHAT if self.chat else COMPLETIONS)


def normalize_base_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--base-url {url!r} must start with http:// or https://")
    return url.removesuffix("/v1")


def parse_extra_body(text: str | None) -> dict[str, Any]:
    """The --extra-body option: a JSON object, none of whose keys is reserved; {} when not given."""
    if text is None:
        return {}
    try:
        extra = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"--extra-body is not valid JSON: {exc}") from None
    if not isinstance(extra, dict):
        raise ValueError(f"--extra-body must be a JSON object like '{{\"cache_prompt\": false}}', got {text!r}")
    check_extra_body(extra)
    return extra


def check_extra_body(extra: Mapping[str, Any]) -> None:
    if reserved := sorted(RESERVED_KEYS.intersection(extra)):
        raise ValueError(f"--extra-body must not set {', '.join(reserved)}: folio bench serve sets it itself")


def request_body(target: Target, request: ServeRequest) -> dict[str, Any]:
    body: dict[str, Any] = {"model": target.model}
    if target.chat:
        messages = request.messages if request.messages is not None else [{"role": "user", "content": request.prompt}]
        body["messages"] = list(messages)
    else:
        body["prompt"] = request.prompt
    body.update(max_tokens=request.output_len, temperature=0.0, ignore_eos=True, stream=True)
    if target.include_usage:
        body["stream_options"] = {"include_usage": True}
    body.update(target.extra_body)  # may change sampling (temperature, ignore_eos, ...); never a reserved key
    return body


def arrival_offsets(num: int, rate: float, seed: int) -> list[float]:
    """Send times (s from the start) of a Poisson process at `rate` requests/s; all zero for inf. Every
    rate scales the same seeded exponential draws, so the runs differ only in pace."""
    if math.isinf(rate):
        return [0.0] * num
    gaps = np.random.default_rng([seed, 3]).exponential(1.0, size=num) / rate
    gaps[0] = 0.0  # the first request goes at once
    return np.cumsum(gaps).tolist()


def request_headers() -> dict[str, str]:
    key = os.environ.get("OPENAI_API_KEY")
    # A new connection for every request; see the module docstring.
    return {"Connection": "close", **({"Authorization": f"Bearer {key}"} if key else {})}


def _error_text(status: int, body: bytes) -> str:
    try:
        message = json.loads(body)["error"]
        message = message.get("message", message) if isinstance(message, dict) else message
    except (ValueError, KeyError, TypeError):
        message = body.decode("utf-8", errors="replace").strip()[:200]
    return f"HTTP {status}: {message}" if message else f"HTTP {status}"


def _chunk_text(choice: dict[str, Any], chat: bool) -> str:
    source = (choice.get("delta") or {}) if chat else choice
    text = source.get("content" if chat else "text")
    return text if isinstance(text, str) else ""


async def send_request(client: Any, target: Target, request: ServeRequest, record: RequestRecord, t0: float,
                       reply: list[str] | None = None) -> None:  # fmt: skip
    """Stream one request and fill `record`, and `reply` with the streamed text's pieces if given; exceptions
    become `record.error`."""
    import httpx

    start = time.perf_counter()
    record.start_s = start - t0
    last_chunk, chunks, usage_tokens = None, 0, None
    try:
        async with (
            asyncio.timeout(target.timeout_s),
            client.stream("POST", target.url, json=request_body(target, request), headers=request_headers()) as resp,
        ):
            record.status = resp.status_code
            if resp.status_code != 200:
                record.error = _error_text(resp.status_code, await resp.aread())
                return
            finished = False
            async for line in resp.aiter_lines():
                now = time.perf_counter()
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    finished = True
                    break
                data = json.loads(payload)
                if "error" in data:
                    error = data["error"]
                    record.error = "stream error: " + str(
                        error.get("message", error) if isinstance(error, dict) else error
                    )
                    return
                if isinstance(data.get("timings"), dict):  # llama-server: speeds, and drafts accepted
                    record.server_timings = data["timings"]
                if isinstance(data.get("usage"), dict) and data["usage"].get("completion_tokens") is not None:
                    usage_tokens = int(data["usage"]["completion_tokens"])
                    if data["usage"].get("prompt_tokens") is not None:
                        record.prompt_tokens = int(data["usage"]["prompt_tokens"])
                    details = data["usage"].get("prompt_tokens_details")
                    if isinstance(details, dict) and details.get("cached_tokens") is not None:
                        record.cached_tokens = int(details["cached_tokens"])
                for choice in data.get("choices") or []:
                    if choice.get("finish_reason"):
                        record.finish_reason = choice["finish_reason"]
                    if text := _chunk_text(choice, target.chat):
                        if reply is not None:
                            reply.append(text)
                        if last_chunk is None:
                            record.ttft_s = now - start
                        else:
                            record.itl_s.append(now - last_chunk)
                        last_chunk, chunks = now, chunks + 1
            if not finished and record.finish_reason is None:
                record.error = "the stream ended without [DONE] or a finish reason"
                return
    except (TimeoutError, httpx.TimeoutException):
        record.error = f"timed out after {target.timeout_s:g}s"
        return
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        record.error = f"bad stream chunk: {exc}"
        return
    record.e2e_s = time.perf_counter() - start
    record.success = True
    if usage_tokens is not None:
        record.output_tokens, record.output_tokens_source = usage_tokens, "usage"
    else:
        record.output_tokens, record.output_tokens_source = chunks, "chunks"


def make_client(target: Target, max_connections: int) -> Any:
    try:
        import httpx
    except ImportError:
        raise RuntimeError("folio bench serve needs httpx: pip install httpx") from None
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a log line per request
    timeout = httpx.Timeout(target.timeout_s, connect=10.0)
    # No keep-alive pool: each request opens its own connection (see the module docstring).
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=0)
    return httpx.AsyncClient(timeout=timeout, limits=limits)


def conversations(requests: list[ServeRequest]) -> list[list[int]]:
    """Indices of `requests` grouped into conversations: consecutive requests of one conversation id form one
    group, and every request without an id is a group of its own."""
    groups: list[list[int]] = []
    for i, request in enumerate(requests):
        if request.conversation is not None and groups and requests[groups[-1][0]].conversation == request.conversation:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def with_replies(request: ServeRequest, replies: list[str]) -> ServeRequest:
    """`request` with its first assistant turns' contents replaced by `replies`, in order."""
    if not request.messages or not replies:
        return request
    messages, answered = [], 0
    for message in request.messages:
        if message["role"] == "assistant" and answered < len(replies):
            message = {**message, "content": replies[answered]}
            answered += 1
        messages.append(message)
    return replace(request, messages=messages)


async def run_rate(
    target: Target,
    requests: list[ServeRequest],
    rate: float,
    seed: int,
    max_concurrency: int | None,
    use_tqdm: bool = True,
    replies_as_history: bool = False,
) -> tuple[list[RequestRecord], float]:
    """Send every request on the Poisson schedule of `rate` (at most `max_concurrency` in flight; a request
    that waits for a slot is timed from when it is sent). Returns the records and the run's duration.

    A conversation (see `conversations`) arrives as one: its first request at its Poisson time, each later one
    as soon as the one before has finished, failed or not, so `rate` counts conversations. Its messages come
    from the dataset, or with `replies_as_history` its earlier assistant turns are the server's replies."""
    groups = conversations(requests)
    offsets = arrival_offsets(len(groups), rate, seed)
    records = [
        RequestRecord(i, r.prompt_len, r.output_len, conversation=r.conversation, turn=r.turn)
        for i, r in enumerate(requests)
    ]
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), desc=f"rate {format_rate(rate)}", unit="req", disable=not use_tqdm or None)

    async with make_client(target, max_concurrency or len(requests)) as client:
        t0 = time.perf_counter()

        async def one(group: list[int], offset: float) -> None:
            await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
            replies: list[str] = []  # the server's answers to this conversation's turns so far
            for i in group:
                request, reply = requests[i], [] if replies_as_history else None
                if replies_as_history:
                    request = with_replies(request, replies)
                if limit is None:
                    await send_request(client, target, request, records[i], t0, reply)
                else:
                    async with limit:
                        await send_request(client, target, request, records[i], t0, reply)
                if reply is not None:
                    replies.append("".join(reply))
                bar.update(1)

        tasks = [one(group, offset) for group, offset in zip(groups, offsets, strict=True)]
        try:
            await asyncio.gather(*tasks)
        finally:
            bar.close()
        duration = time.perf_counter() - t0
    return records, duration


async def probe(target: Target, request: ServeRequest, with_request: bool = True) -> tuple[Target, dict[str, Any]]:
    """Check the server before timing anything: list its models and send one short request. A server that
    refuses `stream_options` is asked again without it, and output tokens are then counted from chunks.
    `with_request=False` only lists the models: a static-batching server would hold a lone request until
    a full batch arrived. Raises RuntimeError with one line when the server cannot be used."""
    import httpx

    info: dict[str, Any] = {"models": None, "server_header": None, "include_usage": target.include_usage}
    short = replace(request, output_len=min(request.output_len, 2))
    async with make_client(target, 1) as client:
        try:
            resp = await client.get(target.base_url + "/v1/models", headers=request_headers())
        except httpx.HTTPError as exc:
            raise RuntimeError(f"cannot reach the server at {target.base_url}: {exc or type(exc).__name__}") from None
        info["server_header"] = resp.headers.get("server")
        if resp.status_code == 200:
            with contextlib.suppress(ValueError, AttributeError):
                info["models"] = [m.get("id") for m in resp.json().get("data", [])]
        if not with_request:
            info["probe_output_tokens_source"] = None
            return target, info
        record = RequestRecord(0, short.prompt_len, short.output_len)
        await send_request(client, target, short, record, time.perf_counter())
        if (
            not record.success
            and target.include_usage
            and record.status == 400
            and "stream_options" in str(record.error)
        ):
            target = replace(target, include_usage=False)
            info["include_usage"] = False
            record = RequestRecord(0, short.prompt_len, short.output_len)
            await send_request(client, target, short, record, time.perf_counter())
    if not record.success:
        served = f" (the server lists: {', '.join(map(str, info['models']))})" if info["models"] else ""
        raise RuntimeError(f"the first request to {target.url} failed: {record.error}{served}")
    info["probe_output_tokens_source"] = record.output_tokens_source
    return target, info
