"""The workloads of `folio bench serve` that share prefixes (document, tenants, multi-turn; agent in
test_bench_agent_workload.py), the chaining of a
conversation's turns, and the prefix-cache counters scraped from /metrics: against canned streams, the packaged
ShareGPT text with a real tokenizer, and a real folio server on a tiny random Llama (with and without /metrics)."""

from __future__ import annotations

import asyncio
import json
import math
import time

import httpx
import numpy as np
import pytest
from folio_tools.bench.harness.datasets import LengthRange, output_lens
from folio_tools.bench.serve import client as serve_client
from folio_tools.bench.serve.client import ServeRequest, Target, conversations, run_rate
from folio_tools.bench.serve.command import ServeConfig, run_serve
from folio_tools.bench.serve.metrics import NOT_REPORTED, parse_prefix_cache, prefix_cache_delta
from folio_tools.bench.serve.prefix_workloads import make_document, sharegpt_answers
from folio_tools.bench.serve.report import format_table
from folio_tools.bench.serve.workload import build_serve_requests, load_tokenizer

from folio.cli import main
from tests.api.server_runner import running_server
from tests.tiny_models import make_tiny_chat_model

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")
pytestmark = pytest.mark.usefixtures("peaks_measured_once")

MODEL = "tiny-llama"
BLOCK = 16  # folio's default KV block size: the prefix cache hits whole blocks


def words(n: int, start: int) -> str:
    """`n` words of the tiny tokenizer's vocabulary (t10..t309), one token each."""
    return " ".join(f"t{10 + (start + 7 * j) % 300}" for j in range(n))


def write_sharegpt(path):
    """Six conversations of three user turns with 20-30-word answers, one of a single turn, one that does not
    alternate; every word a token of the tiny tokenizer."""
    records = []
    for c in range(6):
        turns = []
        for k in range(3):
            turns.append({"from": "human", "value": words(3 + (c + k) % 4, 100 * c + 10 * k)})
            turns.append({"from": "gpt", "value": words(20 + (c * k) % 11, 100 * c + 10 * k + 5)})
        records.append({"id": f"c{c}", "conversations": turns})
    records.append({"id": "one", "conversations": [{"from": "human", "value": "t1"}, {"from": "gpt", "value": "t2"}]})
    records.append({"id": "odd", "conversations": [{"from": "human", "value": "t1"}] * 6})
    path.write_text(json.dumps(records))
    return path


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_chat_model(tmp_path_factory.mktemp("prefix") / "llama")


@pytest.fixture(scope="module")
def sharegpt(tmp_path_factory):
    return write_sharegpt(tmp_path_factory.mktemp("sharegpt") / "sharegpt.json")


@pytest.fixture(scope="module")
def base_url(tiny_llama):
    from folio import LLM

    with running_server(LLM(tiny_llama, kv_cache_memory="16MiB"), MODEL) as (url, _):
        yield url


# -- building the workloads -----------------------------------------------------------------------------


def _split(prompt: str) -> tuple[str, str]:
    document, _, question = prompt.partition("\n\nQuestion ")
    return document, "\n\nQuestion " + question


def test_document_requests_share_one_seeded_document(tiny_llama, sharegpt):
    tokenizer = load_tokenizer(str(tiny_llama), explicit=True)
    encode = tokenizer.tokenizer.encode

    def build(seed: int, num: int = 6):
        return build_serve_requests("document", tokenizer, num, LengthRange(1, 2), LengthRange(2, 9), seed,
                                    str(sharegpt), document_len=100)  # fmt: skip

    workload = build(1)
    assert workload.facts == {"document_tokens": 100}
    requests = workload.requests
    documents = {_split(r.prompt)[0] for r in requests}
    [document] = documents  # the same document in front of every request
    assert len(encode(document)) == 100 and all(w.startswith("t") for w in document.split())
    questions = [_split(r.prompt)[1] for r in requests]
    assert len(set(questions)) == 6 and questions[0].startswith("\n\nQuestion 1: ")
    assert all(10 <= len(encode(q)) <= 40 for q in questions)
    assert [r.prompt_len for r in requests] == [len(encode(r.prompt)) for r in requests]
    assert [r.output_len for r in requests] == output_lens(6, LengthRange(2, 9), 1)
    assert all(r.messages is None and r.conversation is None for r in requests)
    assert build(1).requests == requests  # seeded
    assert {_split(r.prompt)[0] for r in build(2).requests} != documents
    with pytest.raises(ValueError, match="lower --document-len"):
        build_serve_requests("document", tokenizer, 2, LengthRange(1, 2), LengthRange(2, 9), 1, str(sharegpt),
                             document_len=100_000)  # fmt: skip


def test_tenant_requests_draw_their_tenants_documents(tiny_llama, sharegpt):
    tokenizer = load_tokenizer(str(tiny_llama), explicit=True)
    encode, decode = tokenizer.tokenizer.encode, tokenizer.tokenizer.decode

    def build(seed: int, tenants: int = 3, num: int = 12):
        return build_serve_requests("tenants", tokenizer, num, LengthRange(1, 2), LengthRange(2, 9), seed,
                                    str(sharegpt), document_len=60, tenants=tenants)  # fmt: skip

    workload = build(1)
    assert workload.facts == {"tenants": 3, "tenant_document_tokens": [60, 60, 60]}
    requests = workload.requests
    # Tenant t's document is make_document's with seed 1000 * seed + t; each request draws its tenant.
    alone = lambda text: encode(text, add_special_tokens=False)  # noqa: E731
    documents = [make_document(sharegpt_answers(sharegpt), alone, decode, 60, 1000 + t) for t in range(3)]
    tenants = [documents.index(_split(r.prompt)[0]) for r in requests]  # each prompt starts with a tenant's
    assert tenants == list(np.random.default_rng([1, 8]).integers(3, size=12)) and set(tenants) == {0, 1, 2}
    assert len({d.split()[0] for d in documents}) == 3  # the tenants differ from their first word
    assert all(len(encode(d)) == 60 and all(w.startswith("t") for w in d.split()) for d in documents)
    for t in range(3):  # each tenant's questions distinct and numbered in order
        questions = [_split(r.prompt)[1] for r, owner in zip(requests, tenants, strict=True) if owner == t]
        assert len(set(questions)) == len(questions) and questions[0].startswith("\n\nQuestion 1: ")
    assert [r.prompt_len for r in requests] == [len(encode(r.prompt)) for r in requests]
    assert [r.output_len for r in requests] == output_lens(12, LengthRange(2, 9), 1)
    assert all(r.messages is None and r.conversation is None for r in requests)
    assert build(1).requests == requests  # seeded
    assert {_split(r.prompt)[0] for r in build(2).requests}.isdisjoint(documents)
    [one] = {_split(r.prompt)[0] for r in build(1, tenants=1).requests}
    assert one == documents[0]
    with pytest.raises(ValueError, match="lower --document-len"):
        build_serve_requests("tenants", tokenizer, 2, LengthRange(1, 2), LengthRange(2, 9), 1, str(sharegpt),
                             document_len=100_000)  # fmt: skip


def test_document_from_the_packaged_sharegpt_text():
    tokenizer = load_tokenizer("smollm2-135m", explicit=False)
    workload = build_serve_requests("document", tokenizer, 4, LengthRange(1, 2), LengthRange(2, 9), 0)
    [document] = {_split(r.prompt)[0] for r in workload.requests}
    alone = tokenizer.tokenizer.encode(document, add_special_tokens=False)
    assert workload.facts["document_tokens"] == len(alone) and abs(len(alone) - 2000) <= 20
    assert document.isascii() or sum(c.isascii() for c in document) > 0.95 * len(document)
    for request in workload.requests:
        question = tokenizer.tokenizer.encode(_split(request.prompt)[1], add_special_tokens=False)
        assert 10 <= len(question) <= 50  # a seeded 10-40, overshot by at most the last word added
        assert request.prompt_len >= len(alone) + len(question) - 2  # the two re-tokenized at their seam


def test_multi_turn_requests_grow_by_the_datasets_answers(tiny_llama, sharegpt):
    tokenizer = load_tokenizer(str(tiny_llama), explicit=True)
    records = json.loads(sharegpt.read_text())
    turns_of = {tuple(t["value"] for t in r["conversations"][:5]): r["id"] for r in records}

    def build(turns: int, num: int = 4, seed: int = 0):
        return build_serve_requests("multi-turn", tokenizer, num, LengthRange(1, 500), LengthRange(2, 9), seed,
                                    str(sharegpt), turns=turns)  # fmt: skip

    workload = build(3)
    requests = workload.requests
    assert workload.facts == {"conversations": 4, "turns": 3} and len(requests) == 12
    assert [(r.conversation, r.turn) for r in requests] == [(c, k) for c in range(4) for k in range(3)]
    assert conversations(requests) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    assert [r.output_len for r in requests] == output_lens(12, LengthRange(2, 9), 0)
    for first, second, third in zip(requests[::3], requests[1::3], requests[2::3], strict=True):
        assert [m["role"] for m in third.messages] == ["user", "assistant", "user", "assistant", "user"]
        assert first.messages == third.messages[:1] and second.messages == third.messages[:3]
        texts = tuple(m["content"] for m in third.messages)
        assert turns_of[texts].startswith("c")  # word for word a dataset conversation, answers included
        assert [r.prompt for r in (first, second, third)] == [texts[0], texts[2], texts[4]]
        assert third.prompt_len == sum(len(tokenizer.tokenizer.encode(t)) for t in texts)
    assert len({r.messages[0]["content"] for r in requests}) == 4  # four different conversations
    assert build(3).requests == requests and build(3, seed=1).requests != requests
    assert len(build(1).requests) == 4  # one turn: every conversation has it
    with pytest.raises(ValueError, match="lower --turns"):
        build(4)
    with pytest.raises(ValueError, match="widen --input-len-range"):
        build_serve_requests("multi-turn", tokenizer, 2, LengthRange(1, 5), LengthRange(2, 9), 0, str(sharegpt),
                             turns=3)  # fmt: skip


# -- sending a conversation -------------------------------------------------------------------------------


def _sse(*events: object) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


def test_a_conversations_turns_go_out_one_after_another(monkeypatch):
    events: list[tuple[str, str, int]] = []
    bodies: list[dict] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        bodies.append(body)
        key = (body["messages"][0]["content"], len(body["messages"]))
        events.append(("send", *key))

        async def stream():
            await asyncio.sleep(0.03)
            yield _sse({"choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": None}]})
            await asyncio.sleep(0.03)
            events.append(("end", *key))  # before the last chunk: the client stops reading at [DONE]
            yield _sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}, "[DONE]")

        return httpx.Response(200, content=stream())

    monkeypatch.setattr(
        serve_client, "make_client", lambda *_: httpx.AsyncClient(transport=httpx.MockTransport(handler))
    )
    history = {c: [f"{c} user {k // 2}" if k % 2 == 0 else f"{c} answer {k // 2}" for k in range(5)] for c in "AB"}
    requests = [
        ServeRequest(
            history[c][2 * k],
            1,
            2,
            conversation=i,
            turn=k,
            messages=[
                {"role": "user" if j % 2 == 0 else "assistant", "content": t}
                for j, t in enumerate(history[c][: 2 * k + 1])
            ],
        )  # fmt: skip
        for i, c in enumerate("AB")
        for k in range(3)
    ]
    target = Target("http://test", "m", chat=True, include_usage=False)
    records, _ = asyncio.run(run_rate(target, requests, math.inf, 0, max_concurrency=None, use_tqdm=False))

    assert all(r.success for r in records), [r.error for r in records]
    assert [(r.conversation, r.turn) for r in records] == [(c, k) for c in range(2) for k in range(3)]
    for c in ("A user 0", "B user 0"):
        mine = [e for e in events if e[1] == c]
        # send, end of turn 0, then send of turn 1 (3 messages), its end, then turn 2 (5 messages)
        assert mine == [("send", c, 1), ("end", c, 1), ("send", c, 3), ("end", c, 3), ("send", c, 5), ("end", c, 5)]
    assert {e[:2] for e in events[:2]} == {("send", "A user 0"), ("send", "B user 0")}  # both open at once
    for body in bodies:  # the dataset's own answers between the user turns, never the model's "a"
        assert [m["content"] for m in body["messages"]] == history[body["messages"][0]["content"][0]][
            : len(body["messages"])
        ]
    for first, second in zip(records, records[1:], strict=False):
        if first.conversation == second.conversation:
            assert second.start_s >= first.start_s + first.e2e_s - 1e-3


def test_conversations_arrive_at_the_poisson_times(monkeypatch):
    starts: dict[int, float] = {}

    async def handler(request: httpx.Request) -> httpx.Response:
        starts.setdefault(len(starts), time.perf_counter())
        return httpx.Response(200, content=_sse({"choices": [{"index": 0, "text": "a", "finish_reason": "length"}]},
                                                "[DONE]"))  # fmt: skip

    monkeypatch.setattr(
        serve_client, "make_client", lambda *_: httpx.AsyncClient(transport=httpx.MockTransport(handler))
    )
    requests = [ServeRequest("x", 1, 1, conversation=c, turn=k) for c in range(3) for k in range(2)]
    records, _ = asyncio.run(run_rate(Target("http://t", "m", False), requests, 5.0, 4, None, use_tqdm=False))
    offsets = serve_client.arrival_offsets(3, 5.0, 4)  # one Poisson time a conversation
    for c in range(3):
        assert records[2 * c].start_s >= offsets[c] - 1e-3 and records[2 * c].start_s < offsets[c] + 0.2


# -- prefix-cache counters --------------------------------------------------------------------------------


def test_prefix_cache_counters_are_parsed_from_prometheus_text():
    text = """# HELP folio:prefix_cache_queries_total Prompt tokens looked up in the prefix cache.
# TYPE folio:prefix_cache_queries_total counter
folio:prefix_cache_queries_total{model_name="a"} 300.0
folio:prefix_cache_queries_total{model_name="b"} 100.0
folio:prefix_cache_hits_total{model_name="a"} 160.0
folio:prompt_tokens_total{model_name="a"} 9.0
"""
    assert parse_prefix_cache(text) == (400.0, 160.0)
    assert parse_prefix_cache(text.replace("hits", "misses")) is None  # both or nothing
    assert parse_prefix_cache("vllm:prefix_cache_queries_total 8\nvllm:prefix_cache_hits_total 4\n") == (8.0, 4.0)
    assert parse_prefix_cache("llamacpp:prompt_tokens_total 5\n") is None
    assert prefix_cache_delta((400.0, 160.0), (600.0, 310.0)) == {
        "queried_tokens": 200,
        "hit_tokens": 150,
        "hit_rate": 0.75,
    }
    assert prefix_cache_delta((1.0, 0.0), (1.0, 0.0))["hit_rate"] is None
    assert prefix_cache_delta(None, (1.0, 0.0)) == NOT_REPORTED == prefix_cache_delta((1.0, 0.0), None)


def test_document_run_reports_prefix_cache_hits(tiny_llama, sharegpt, base_url, tmp_path, capsys):
    code = main([
        "bench", "serve", "--base-url", base_url, "--model", MODEL, "--tokenizer", str(tiny_llama),
        "--dataset", "document", "--dataset-path", str(sharegpt), "--document-len", "100", "--num-prompts", "4",
        "--output-len-range", "2:4", "--output-dir", str(tmp_path),
    ])  # fmt: skip
    assert code == 0
    [json_path] = tmp_path.glob("*.json")
    report = json.loads(json_path.read_text())
    assert report["endpoint"] == "/v1/completions" and report["workload"]["document_tokens"] == 100
    assert report["settings"]["document_len"] == 100 and "--document-len 100" in report["command"]
    [result] = report["results"]
    assert result["completed"] == 4
    cache = result["prefix_cache"]
    # Every prompt was looked up once; the probe request had already cached the document's six full blocks.
    assert cache["queried_tokens"] == result["prompt_tokens"]
    assert cache["hit_tokens"] % BLOCK == 0 and cache["hit_tokens"] >= 4 * (100 // BLOCK) * BLOCK
    assert cache["hit_rate"] == pytest.approx(cache["hit_tokens"] / cache["queried_tokens"]) and cache["hit_rate"] > 0.5
    printed = capsys.readouterr().out
    assert "document (a 100-token document), 4 requests" in printed
    assert f"prefix hit tok{cache['hit_tokens']:>18}" in printed and "prefix hit rate" in printed


def test_multi_turn_run_chains_turns_on_the_server(tiny_llama, sharegpt, base_url, tmp_path):
    code = main([
        "bench", "serve", "--base-url", base_url, "--model", MODEL, "--tokenizer", str(tiny_llama),
        "--dataset", "multi-turn", "--dataset-path", str(sharegpt), "--turns", "3", "--num-prompts", "3",
        "--request-rate", "50", "--input-len-range", "1:500", "--output-len-range", "2:4",
        "--output-dir", str(tmp_path),
    ])  # fmt: skip
    assert code == 0
    [json_path] = tmp_path.glob("*.json")
    report = json.loads(json_path.read_text())
    assert report["endpoint"] == "/v1/chat/completions" and report["settings"]["turns"] == 3
    assert report["workload"]["conversations"] == 3 and report["workload"]["num_requests"] == 9
    [result] = report["results"]
    assert result["completed"] == 9
    records = result["requests"]
    assert [(r["conversation"], r["turn"]) for r in records] == [(c, k) for c in range(3) for k in range(3)]
    for first, second in zip(records, records[1:], strict=False):
        if first["conversation"] == second["conversation"]:
            assert second["start_s"] >= first["start_s"] + first["e2e_s"] - 1e-3
            assert second["prompt_tokens"] > first["prompt_tokens"]
    assert result["prefix_cache"]["hit_tokens"] > 0  # a third turn finds its second turn's prompt


def test_a_server_without_metrics_is_not_reported(tiny_llama):
    from folio import LLM

    with running_server(LLM(tiny_llama, kv_cache_memory="4MiB"), MODEL) as (url, server):
        server.app.router.routes[:] = [r for r in server.app.router.routes if getattr(r, "path", "") != "/metrics"]
        assert httpx.get(f"{url}/metrics").status_code == 404
        config = ServeConfig(url, MODEL, LengthRange(4, 8), LengthRange(2, 3), num_prompts=2,
                             tokenizer=str(tiny_llama), use_tqdm=False)  # fmt: skip
        report = run_serve(config, "cmd")
    [result] = report.results
    assert result.summary["completed"] == 2 and result.summary["prefix_cache"] == NOT_REPORTED
    assert report.to_dict()["results"][0]["prefix_cache"] == "not reported"
    table = format_table(report)
    assert "prefix hit rate" not in table
    assert table.endswith("prefix cache: not reported (the server has no prefix_cache_* counters at /metrics)")


# -- serve-compare: with and without the prefix cache --------------------------------------------------------


def test_serve_compare_with_and_without_the_prefix_cache(tiny_llama, sharegpt, tmp_path, capsys):
    out_dir = tmp_path / "out"
    code = main([
        "bench", "serve-compare", str(tiny_llama), "--peer", "folio-no-prefix-cache", "--dataset", "document",
        "--dataset-path", str(sharegpt), "--document-len", "100", "--num-prompts", "4", "--output-len-range", "2:4",
        "--kv-cache-memory", "16MiB", "--output-dir", str(out_dir),
    ])  # fmt: skip
    assert code == 0
    [json_path] = out_dir.glob("*.json")
    report = json.loads(json_path.read_text())
    folio, uncached = report["servers"]
    assert (folio["name"], uncached["name"]) == ("folio", "folio-no-prefix-cache")
    assert "--no-prefix-caching" not in folio["command"] and "--no-prefix-caching" in uncached["command"]
    assert (
        uncached["command"].replace(" --no-prefix-caching", "").split("--port")[0]
        == folio["command"].split("--port")[0]
    )  # the same folio serve otherwise
    assert uncached["info"]["enable_prefix_caching"] is False
    [ours] = folio["result"]["results"]
    [theirs] = uncached["result"]["results"]
    assert ours["completed"] == theirs["completed"] == 4
    assert ours["prefix_cache"]["hit_rate"] > 0.5
    assert theirs["prefix_cache"]["hit_tokens"] == 0 and theirs["prefix_cache"]["queried_tokens"] > 0
    [row] = report["ratios"]
    assert row["metrics"]["prefix_cache_hit_rate"]["folio-no-prefix-cache"] == 0
    assert row["metrics"]["p50_ttft_ms"]["ratio"] == pytest.approx(ours["ttft_ms"]["p50"] / theirs["ttft_ms"]["p50"])
    printed = capsys.readouterr().out
    assert printed.startswith(f"folio vs folio-no-prefix-cache: {tiny_llama}, document, 4 requests")
    assert "folio/folio-no-prefix-cache" in printed and "p50 TTFT ms" in printed and "prefix hit rate" in printed
