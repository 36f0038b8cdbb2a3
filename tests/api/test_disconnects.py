"""Clients that hang up: the engine drops their requests within a step (streaming or not, n > 1,
best_of, beam search, still queued), the KV blocks and admission slots come back, and the request is
counted as aborted."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from folio import LLM
from folio.server.serve import ServerOptions
from tests.api.server_runner import MODEL, aborted_requests, running_server

STORY = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 3000, "ignore_eos": True}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 3000,
        "ignore_eos": True}  # fmt: skip


def _wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def _hang_up_after(url: str, path: str, body: dict, seconds: float) -> None:
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}{path}", json=body, timeout=seconds)


def _idle(server) -> bool:
    engine = server.engine.engine
    pool = engine.kv.pool
    return not engine.has_unfinished() and pool.num_free_blocks == pool.num_blocks


@pytest.mark.parametrize(
    ("path", "body", "requests"),
    [
        ("/v1/chat/completions", CHAT, 1),
        ("/v1/chat/completions", {**CHAT, "n": 3, "temperature": 1.0}, 3),
        ("/v1/completions", {**STORY, "n": 2, "best_of": 3}, 3),
        ("/v1/completions", {**STORY, "use_beam_search": True, "beam_width": 3, "n": 2}, 2),
    ],
    ids=["chat", "chat n=3", "best_of", "beam search"],
)
def test_a_non_streaming_client_that_hangs_up_stops_its_generation(served, path, body, requests):
    url, server = served
    before = aborted_requests(url)
    _hang_up_after(url, path, body, 2.0)
    started = time.monotonic()
    _wait_for(lambda: _idle(server), timeout=5)
    assert time.monotonic() - started < 2.0  # aborted within a step or so, not run to 3000 tokens
    assert aborted_requests(url) == before + requests
    assert server.context.admission.in_flight == 0


def test_a_streaming_client_that_hangs_up_with_several_choices_stops_them_all(served):
    url, server = served
    before = aborted_requests(url)
    with httpx.stream("POST", f"{url}/v1/completions", json={**STORY, "n": 3, "stream": True}, timeout=30) as r:
        for _, _line in zip(range(8), r.iter_lines(), strict=False):
            pass
    _wait_for(lambda: _idle(server), timeout=5)
    assert aborted_requests(url) == before + 3 and server.context.admission.in_flight == 0


@pytest.fixture(scope="module")
def single(smollm2_gguf):
    """One running sequence and a queue: the second request waits."""
    llm = LLM(smollm2_gguf, kv_cache_memory="64MiB", max_num_seqs=1)
    with running_server(llm, MODEL, ServerOptions(max_queue=4)) as (url, server):
        yield url, server


def _stream_then_hang_up(url: str, path: str, body: dict, seconds: float) -> None:
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=30) as response:
        assert response.status_code == 200
        time.sleep(seconds)


@pytest.mark.parametrize("hang_up", [_hang_up_after, _stream_then_hang_up], ids=["whole", "streamed"])
def test_a_queued_request_whose_client_hangs_up_leaves_the_queue(single, hang_up):
    url, server = single
    scheduler = server.engine.engine.scheduler
    lines: list[str] = []

    def running() -> None:
        body = {**STORY, "max_tokens": 150, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            lines.extend(line for line in r.iter_lines() if line)

    first = threading.Thread(target=running)
    first.start()
    _wait_for(lambda: len(scheduler.running) == 1)
    waiter = threading.Thread(target=hang_up, args=(url, "/v1/chat/completions", CHAT, 1.0))
    waiter.start()
    _wait_for(lambda: len(scheduler.waiting) == 1)
    waiter.join()
    _wait_for(lambda: not scheduler.waiting, timeout=3)  # dropped while the first still runs
    assert len(scheduler.running) == 1
    first.join(60)
    assert lines[-1] == "data: [DONE]"
    _wait_for(lambda: _idle(server) and server.context.admission.in_flight == 0)
