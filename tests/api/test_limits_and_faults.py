"""Faults and limits against real servers: client disconnects, the admission limit (429), API keys,
metrics, many concurrent streams, and SIGTERM with requests in flight."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading
import time

import anthropic
import httpx
import ollama
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from folio import LLM
from folio.server.serve import ServerOptions
from tests.api.server_runner import MODEL, free_port, running_server

KEY = "sekret-key"
LONG = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 2000, "ignore_eos": True, "stream": True}


def _metrics(base_url: str) -> dict[tuple[str, tuple], float]:
    samples = {}
    for family in text_string_to_metric_families(httpx.get(f"{base_url}/metrics").text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "le")))
            if "le" not in s.labels:
                samples[(s.name, labels)] = s.value
    return samples


def _wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_metrics_count_exactly(base_url, client):
    before = _metrics(base_url)
    result = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=7, temperature=0,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    after = _metrics(base_url)

    def delta(name: str, labels: tuple = ()) -> float:
        return after[(name, labels)] - before.get((name, labels), 0.0)

    assert delta("folio:prompt_tokens_total") == result.usage.prompt_tokens
    assert delta("folio:generation_tokens_total") == 7
    assert delta("folio:request_success_total", (("finished_reason", "length"),)) == 1
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                      "time_per_output_token_seconds"):  # fmt: skip
        assert delta(f"folio:{histogram}_count") == 1
    assert delta("folio:inter_token_latency_seconds_count") == 6
    assert after[("folio:num_requests_running", ())] == 0 and after[("folio:kv_cache_usage_ratio", ())] == 0
    assert ("folio:num_preemptions_total", ()) in after and ("folio:num_requests_waiting", ()) in after


def test_disconnect_mid_stream_aborts_and_frees_the_kv_cache(base_url, served):
    pool = served[1].engine.engine.kv.pool
    aborted_before = _metrics(base_url).get(("folio:request_success_total", (("finished_reason", "abort"),)), 0)
    with httpx.stream("POST", f"{base_url}/v1/completions", json=LONG, timeout=30) as response:
        events = response.iter_lines()
        received = [line for line, _ in zip(events, range(6), strict=False) if line.startswith("data:")]
        assert received and pool.num_free_blocks < pool.num_blocks  # the request holds KV while it runs
    _wait_for(lambda: pool.num_free_blocks == pool.num_blocks)
    metrics = _metrics(base_url)
    assert metrics[("folio:request_success_total", (("finished_reason", "abort"),))] == aborted_before + 1
    assert metrics[("folio:num_requests_running", ())] == 0


def test_32_concurrent_streaming_chats_complete_with_exact_usage(base_url):
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, int, int, str]:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Give me fact number {i} about cats."}],
            max_tokens=12, temperature=0.8, seed=i, stream=True, stream_options={"include_usage": True},
            logprobs=True,
        )  # fmt: skip
        tokens, finish, usage = 0, None, None
        async for chunk in stream:
            for choice in chunk.choices:
                tokens += len(choice.logprobs.content) if choice.logprobs and choice.logprobs.content else 0
                finish = choice.finish_reason or finish
            usage = chunk.usage or usage
        return tokens, usage.completion_tokens, usage.prompt_tokens, finish

    async def run_all():
        async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    results = asyncio.run(run_all())
    for i, (tokens, completion_tokens, prompt_tokens, finish) in enumerate(results):
        messages = [{"role": "user", "content": f"Give me fact number {i} about cats."}]
        expected_prompt = httpx.post(f"{base_url}/tokenize", json={"messages": messages}).json()["count"]
        assert finish in ("stop", "length") and tokens == completion_tokens >= 1 and prompt_tokens == expected_prompt


@pytest.fixture(scope="module")
def limited(smollm2_gguf):
    """Two running sequences, one queue slot, an API key."""
    llm = LLM(smollm2_gguf, kv_cache_memory="256MiB", max_num_seqs=2)  # room for both, no preemption
    with running_server(llm, MODEL, ServerOptions(max_queue=1, api_key=KEY)) as (url, server):
        yield url, server


def test_api_key_guards_every_route_but_health(limited):
    url, _ = limited
    assert httpx.get(f"{url}/health").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        response = httpx.get(f"{url}/v1/models", headers=headers)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{url}/metrics").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    good = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    assert good.completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens == 2
    # Each API's clients send the key their own way, and hear the refusal in their own format.
    refused = httpx.get(f"{url}/api/tags")
    assert refused.status_code == 401 and "API key" in refused.json()["error"]
    assert ollama.Client(host=url, headers={"Authorization": f"Bearer {KEY}"}).list().models
    with pytest.raises(anthropic.AuthenticationError) as caught:
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.count_tokens(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}])  # fmt: skip
    assert caught.value.body["error"]["type"] == "authentication_error"
    counted = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0).messages.count_tokens(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}])  # x-api-key  # fmt: skip
    assert counted.input_tokens > 0


def test_requests_beyond_the_queue_get_429_and_the_server_recovers(limited):
    url, server = limited
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=url, headers=headers, timeout=60) as http:
        streams = [http.stream("POST", "/v1/completions", json=LONG) for _ in range(3)]
        responses = [s.__enter__() for s in streams]
        try:
            assert all(r.status_code == 200 for r in responses)
            scheduler = server.engine.engine.scheduler
            _wait_for(lambda: len(scheduler.running) == 2 and len(scheduler.waiting) == 1)
            refused = http.post("/v1/completions", json={**LONG, "stream": False})
            assert refused.status_code == 429 and refused.headers["Retry-After"] == "1"
            assert refused.json()["error"]["type"] == "rate_limit_error"

            def gauges() -> tuple[float, float]:
                text = http.get("/metrics").text
                values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
                return values["folio:num_requests_running"], values["folio:num_requests_waiting"]

            _wait_for(lambda: gauges() == (2, 1))  # gauges follow the scheduler after each step
        finally:
            for stream in streams:
                stream.__exit__(None, None, None)
        pool = server.engine.engine.kv.pool
        _wait_for(lambda: pool.num_free_blocks == pool.num_blocks)
        ok = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_sigterm_lets_in_flight_requests_finish_then_exits_0(smollm2_gguf):
    port = free_port()  # smollm2_gguf: the catalog model is pulled, so the server finds it by name
    process = subprocess.Popen(
        [sys.executable, "-m", "folio.cli", "serve", MODEL, "--port", str(port),
         "--kv-cache-memory", "64MiB", "--grace-period", "60"],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for(lambda: process.poll() is None and _healthy(url), timeout=120)
        chunks: list[str] = []
        first_chunk = threading.Event()

        def stream() -> None:
            body = {**LONG, "max_tokens": 40}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    chunks.append(line)
                    first_chunk.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first_chunk.wait(60)
        process.send_signal(signal.SIGTERM)
        _wait_for(lambda: not _healthy(url), timeout=10)  # no new connections once shutting down
        reader.join(60)
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            process.kill()
    stderr = process.stderr.read()
    assert [c for c in chunks if c][-1] == "data: [DONE]"  # the stream ran to its end
    assert '"finish_reason": "length"' in "\n".join(chunks)
    assert f"at http://127.0.0.1:{port}/v1" in stderr and "KV cache" in stderr, stderr


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_prefix_cache_hits_are_counted_and_cache_salt_keeps_tenants_apart(base_url, client):
    prompt = "Here is a long shared system prompt about cats and dogs. " * 12  # ~150 tokens
    hits = ("folio:prefix_cache_hits_total", ())

    def run(**extra) -> float:
        before = _metrics(base_url)[hits]
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, extra_body=extra)
        return _metrics(base_url)[hits] - before

    run(cache_salt="tenant-a")
    assert run(cache_salt="tenant-b") == 0  # another tenant's identical prompt: no hit
    assert run(cache_salt="tenant-a") >= 128  # the same tenant again: every full block but the last
    assert _metrics(base_url)[("folio:prefix_cache_queries_total", ())] >= _metrics(base_url)[hits]


def test_dynamic_batching_serves_a_lone_request_after_the_timeout(smollm2_gguf):
    llm = LLM(smollm2_gguf, kv_cache_memory="64MiB", batching="dynamic", batch_size=4, batch_timeout_ms=3000)
    with running_server(llm, MODEL) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        started = time.monotonic()
        stream = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, stream=True)
        chunks = list(stream)
        first_wait = time.monotonic() - started
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
        assert first_wait >= 3.0  # it waited for company, then ran alone

        async def four():
            async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as c:
                calls = [c.completions.create(model=MODEL, prompt=f"Count {i}", max_tokens=3) for i in range(4)]
                return await asyncio.gather(*calls)

        started = time.monotonic()
        results = asyncio.run(four())
        assert all(r.usage.completion_tokens == 3 for r in results)
        assert time.monotonic() - started < 3.0  # a full batch starts at once, without the timeout
