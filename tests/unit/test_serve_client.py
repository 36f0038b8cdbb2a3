"""The `folio bench serve` client against canned streams (usage chunk or not, chat deltas, broken
streams, timeouts), its probe, extra request bodies, connections and Poisson arrivals; the config's checks and
when run_serve reads /metrics. No server."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import time
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
from folio_tools.bench.cli import add_bench_parser
from folio_tools.bench.harness.datasets import LengthRange
from folio_tools.bench.harness.flags import command_line
from folio_tools.bench.harness.roofline import MachinePeaks
from folio_tools.bench.serve import client as serve_client
from folio_tools.bench.serve import command as serve
from folio_tools.bench.serve.client import (
    ServeRequest,
    Target,
    arrival_offsets,
    parse_extra_body,
    probe,
    request_body,
    run_rate,
    send_request,
)
from folio_tools.bench.serve.command import ServeConfig, run_serve, workload_config
from folio_tools.bench.serve.stats import (
    RequestRecord,
)

# -- SSE parsing against canned streams ------------------------------------------------------------------


def _sse(*events: object) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


def _send(
    handler, chat: bool = False, include_usage: bool = True, extra_body: dict | None = None
) -> tuple[RequestRecord, list[dict]]:
    bodies: list[dict] = []

    def respond(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return handler(request)

    async def go() -> RequestRecord:
        target = Target("http://test", "m", chat=chat, include_usage=include_usage, extra_body=extra_body or {})
        record = RequestRecord(0, prompt_len=3, output_len=4)
        async with httpx.AsyncClient(transport=httpx.MockTransport(respond)) as client:
            await send_request(client, target, ServeRequest("hi there", 3, 4), record, time.perf_counter())
        return record

    return asyncio.run(go()), bodies


def _text(text: str, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}


def test_usage_chunk_gives_the_token_counts():
    stream = _sse(_text("a"), _text(""), _text("b"), _text("c", "length"),
                  {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4}}, "[DONE]")  # fmt: skip
    record, [body] = _send(lambda _: httpx.Response(200, content=stream))
    assert body == {"model": "m", "prompt": "hi there", "max_tokens": 4, "temperature": 0.0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    assert record.success and record.error is None and record.finish_reason == "length"
    assert (record.output_tokens, record.output_tokens_source, record.prompt_tokens) == (4, "usage", 5)
    assert len(record.itl_s) == 2  # gaps between the three chunks that carry text
    assert 0 < record.ttft_s <= record.e2e_s
    assert record.tpot_s == pytest.approx((record.e2e_s - record.ttft_s) / 3)


def test_llama_server_timings_are_kept_and_only_theirs_written():
    timings = {"predicted_n": 4, "draft_n": 6, "draft_n_accepted": 3}
    stream = _sse(_text("a"), _text("b", "length"),
                  {"choices": [], "usage": {"completion_tokens": 2}, "timings": timings}, "[DONE]")  # fmt: skip
    record, _ = _send(lambda _: httpx.Response(200, content=stream))
    assert record.success and record.server_timings == timings and record.to_dict()["server_timings"] == timings
    plain, _ = _send(lambda _: httpx.Response(200, content=_sse(_text("a", "length"), "[DONE]")))
    assert plain.server_timings is None and "server_timings" not in plain.to_dict()


def test_without_usage_tokens_are_counted_from_chunks():
    stream = _sse(_text("a"), _text("b"), _text("c", "length"), "[DONE]")
    record, [body] = _send(lambda _: httpx.Response(200, content=stream), include_usage=False)
    assert "stream_options" not in body
    assert (record.output_tokens, record.output_tokens_source, record.prompt_tokens) == (3, "chunks", None)


def test_chat_deltas_skip_the_role_chunk():
    def delta(**fields) -> dict:
        return {"choices": [{"index": 0, "delta": fields, "finish_reason": None}]}

    stream = _sse(delta(role="assistant", content=""), delta(content="Hel"), delta(content="lo"),
                  {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}, "[DONE]")  # fmt: skip
    record, [body] = _send(lambda _: httpx.Response(200, content=stream), chat=True, include_usage=False)
    assert body["messages"] == [{"role": "user", "content": "hi there"}] and "prompt" not in body
    assert record.success and record.output_tokens == 2 and len(record.itl_s) == 1
    assert record.finish_reason == "length"


@pytest.mark.parametrize(
    ("response", "error"),
    [
        (httpx.Response(503, json={"error": {"message": "overloaded"}}), "HTTP 503: overloaded"),
        (httpx.Response(200, content=_sse(_text("a"))), "the stream ended without [DONE]"),
        (httpx.Response(200, content=_sse(_text("a"), {"error": {"message": "boom"}})), "stream error: boom"),
        (httpx.Response(200, content=b"data: {not json\n\n"), "bad stream chunk"),
    ],
)
def test_failed_requests_become_records(response, error):
    record, _ = _send(lambda _: response)
    assert not record.success and record.error.startswith(error)
    assert record.e2e_s is None and record.tpot_s is None


def test_refused_connection_becomes_a_record():
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    record, _ = _send(refuse)
    assert not record.success and record.status is None and "ConnectError" in record.error


def test_a_request_past_the_timeout_becomes_a_record():
    async def slow(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(5)
        return httpx.Response(200, content=_sse("[DONE]"))

    async def go() -> RequestRecord:
        record = RequestRecord(0, 1, 1)
        async with httpx.AsyncClient(transport=httpx.MockTransport(slow)) as client:
            await send_request(
                client, Target("http://t", "m", False, timeout_s=0.05), ServeRequest("x", 1, 1), record, 0
            )
        return record

    start = time.perf_counter()
    record = asyncio.run(go())
    assert time.perf_counter() - start < 2
    assert not record.success and record.error == "timed out after 0.05s"


def test_probe_drops_stream_options_when_refused(monkeypatch):
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]}, headers={"server": "fake"})
        if "stream_options" in json.loads(request.content):
            return httpx.Response(400, json={"error": {"message": "stream_options: Extra inputs are not permitted"}})
        return httpx.Response(200, content=_sse(_text("a"), _text("b", "length"), "[DONE]"))

    monkeypatch.setattr(
        serve_client, "make_client", lambda *_: httpx.AsyncClient(transport=httpx.MockTransport(handler))
    )
    target, info = asyncio.run(probe(Target("http://test", "m", chat=False), ServeRequest("hi", 1, 9)))
    assert not target.include_usage
    assert info == {"models": ["m"], "server_header": "fake", "include_usage": False,
                    "probe_output_tokens_source": "chunks"}  # fmt: skip


def test_probe_without_a_request_only_lists_the_models(monkeypatch):
    paths: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        paths.append(request.url.path)
        return httpx.Response(200, json={"data": [{"id": "m"}]})

    monkeypatch.setattr(
        serve_client, "make_client", lambda *_: httpx.AsyncClient(transport=httpx.MockTransport(handler))
    )
    target, info = asyncio.run(probe(Target("http://test", "m", chat=False), ServeRequest("hi", 1, 9), False))
    assert paths == ["/v1/models"] and target.include_usage and info["probe_output_tokens_source"] is None


def test_extra_body_is_merged_and_every_request_asks_for_a_new_connection():
    headers: list[httpx.Headers] = []

    def respond(request: httpx.Request) -> httpx.Response:
        headers.append(request.headers)
        return httpx.Response(200, content=_sse(_text("a"), _text("b", "length"), "[DONE]"))

    extra = {"cache_prompt": False, "temperature": 0.5}
    record, [body] = _send(respond, extra_body=extra)
    assert record.success and body["cache_prompt"] is False and body["temperature"] == 0.5
    assert body["max_tokens"] == 4 and body["stream"] is True
    assert headers[0]["connection"] == "close"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{cache_prompt: false}", "--extra-body is not valid JSON"),
        ("[1, 2]", "--extra-body must be a JSON object"),
        ('{"stream": false, "max_tokens": 3}', "--extra-body must not set max_tokens, stream: folio bench serve"),
    ],
)
def test_bad_extra_body_is_refused(text, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_extra_body(text)


def test_extra_body_parsing_and_command_line():
    assert parse_extra_body(None) == {} and parse_extra_body('{"cache_prompt": false}') == {"cache_prompt": False}
    with pytest.raises(ValueError, match="must not set n:"):
        ServeConfig("http://x", "m", LengthRange(1, 2), LengthRange(1, 2), extra_body={"n": 2})
    args = argparse.Namespace(bench_command="serve", base_url="http://x", extra_body='{"cache_prompt": false}',
                              bench_run=print)  # fmt: skip
    expected = "folio bench serve --base-url http://x --extra-body '{\"cache_prompt\": false}'"
    assert command_line(args, positionals=()) == expected


def test_tenants_and_metrics_lag_settings():
    def config(**settings) -> ServeConfig:
        return ServeConfig("http://x", "m", LengthRange(1, 2), LengthRange(1, 2), **settings)

    with pytest.raises(ValueError, match="--tenants must be at least 1, got 0"):
        config(tenants=0)
    for lag in (-0.5, math.nan):
        with pytest.raises(ValueError, match="--metrics-lag must not be negative"):
            config(metrics_lag_s=lag)
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "serve", "--model", "m", "--dataset", "tenants", "--tenants", "3",
                              "--metrics-lag", "2.5"])  # fmt: skip
    parsed = workload_config(args, "http://x", metrics_lag_s=args.metrics_lag)
    assert (parsed.dataset, parsed.tenants, parsed.document_len, parsed.metrics_lag_s) == ("tenants", 3, 2000, 2.5)
    report = serve.ServeReport("cmd", "date", parsed, "m", "tok", {}, {}, [], {})
    settings = report.to_dict()["settings"]
    assert (settings["tenants"], settings["document_len"], settings["input_len_range"]) == (3, 2000, None)
    assert settings["metrics_lag_s"] == 2.5
    other = serve.ServeReport("cmd", "date", config(dataset="document", tenants=3), "m", "tok", {}, {}, [], {})
    assert other.to_dict()["settings"]["tenants"] is None


@pytest.mark.parametrize(("lag", "probe_request"), [(0.0, True), (2.5, True), (2.5, False)])
def test_counters_are_read_a_metrics_lag_after_the_requests(monkeypatch, lag, probe_request):
    """With a lag, /metrics is read that long after the probe and after each rate's requests, never during them."""
    events: list[str] = []
    workload = SimpleNamespace(requests=[ServeRequest("hi", 1, 2)], facts={})
    monkeypatch.setattr(serve, "load_tokenizer", lambda name, explicit: SimpleNamespace(path="tok"))
    monkeypatch.setattr(serve, "build_serve_requests", lambda *args, **kwargs: workload)
    monkeypatch.setattr(serve, "machine_info", dict)
    monkeypatch.setattr(serve, "measure_machine_peaks", lambda: MachinePeaks("float32", 100.0, 10.0))
    monkeypatch.setattr(serve.TokenCost, "of", classmethod(lambda cls, *args: cls(1, 1, 1, 0, 0)))
    monkeypatch.setattr(serve, "time", SimpleNamespace(sleep=lambda s: events.append(f"sleep {s:g}")))

    async def fake_probe(target, request, with_request):
        events.append("probe")
        return target, {}

    async def fake_run_rate(target, reqs, rate, *args, **kwargs):
        events.append(f"rate {rate:g}")
        return [], 1.0

    def fake_scrape(base_url):
        events.append("scrape")
        return (float(len(events)), 0.0)

    monkeypatch.setattr(serve, "probe", fake_probe)
    monkeypatch.setattr(serve, "run_rate", fake_run_rate)
    monkeypatch.setattr(serve, "scrape_prefix_cache", fake_scrape)
    monkeypatch.setattr(serve, "summarize", lambda *args: {})
    config = ServeConfig("http://x", "m", LengthRange(1, 2), LengthRange(1, 2), request_rates=[1.0, 2.0],
                         probe_request=probe_request, metrics_lag_s=lag, use_tqdm=False)  # fmt: skip
    run_serve(config, "cmd")
    wait = [f"sleep {lag:g}"] if lag else []
    first = wait if probe_request else []
    assert events == ["probe", *first, "scrape", "rate 1", *wait, "scrape", "scrape", "rate 2", *wait, "scrape"]


def test_connections_are_not_reused():
    """A plain HTTP/1.1 server that would keep connections alive: every request must still arrive on a new one."""
    seen = {"connections": 0, "requests": 0}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen["connections"] += 1
        # No [DONE]: the client reads the body to its end, which would leave a kept-alive connection reusable.
        body = _sse(_text("a"), _text("b", "length"))
        try:
            while True:  # serve requests on this connection until the client closes it
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"content-length: *(\d+)", head, flags=re.I)
                await reader.readexactly(int(length.group(1)) if length else 0)
                seen["requests"] += 1
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n")
                writer.write(b"content-length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def go() -> list[RequestRecord]:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        async with server:
            port = server.sockets[0].getsockname()[1]
            target = Target(f"http://127.0.0.1:{port}", "m", chat=False, timeout_s=10)
            requests = [ServeRequest("hi", 1, 2)] * 3
            records, _ = await run_rate(target, requests, math.inf, 0, max_concurrency=1, use_tqdm=False)
        return records

    records = asyncio.run(go())
    assert all(r.success for r in records), [r.error for r in records]
    assert seen == {"connections": 3, "requests": 3}


def test_request_body_for_chat_with_usage():
    body = request_body(Target("http://x", "m", chat=True), ServeRequest("q", 1, 7))
    assert body["messages"] == [{"role": "user", "content": "q"}] and body["max_tokens"] == 7
    assert body["stream_options"] == {"include_usage": True} and body["temperature"] == 0.0


# -- arrivals ------------------------------------------------------------------------------------------


def test_poisson_arrivals_are_seeded_and_scale_with_the_rate():
    assert arrival_offsets(5, math.inf, 0) == [0.0] * 5
    one = np.asarray(arrival_offsets(4000, 1.0, 7))
    assert one[0] == 0.0 and np.all(np.diff(one) >= 0)
    assert np.diff(one).mean() == pytest.approx(1.0, rel=0.05)  # exponential gaps of mean 1/rate
    assert np.asarray(arrival_offsets(4000, 4.0, 7)) == pytest.approx(one / 4)
    assert arrival_offsets(10, 2.0, 7) == arrival_offsets(10, 2.0, 7) != arrival_offsets(10, 2.0, 8)
