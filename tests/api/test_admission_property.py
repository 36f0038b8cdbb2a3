"""A property of the whole server: whatever mix of valid, invalid, cancelled and disconnecting requests
arrives at once, when they are over the admission count, the running and waiting gauges and the KV pool
are all back to zero. Hypothesis draws the mixes (a short run here; FOLIO_FUZZ_EXAMPLES raises it)."""

from __future__ import annotations

import os
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from folio import LLM
from folio.server.serve import ServerOptions
from tests.api.server_runner import MODEL, running_server

PROMPT = {"model": MODEL, "prompt": "Write about the sea."}
INVALID = [
    {**PROMPT, "logit_bias": {"x": 1}},
    {**PROMPT, "top_k": 2**64},
    {**PROMPT, "seed": 2**64, "n": 2},
    {**PROMPT, "stop": ["s"] * 40},
    {**PROMPT, "n": 9},
    {**PROMPT, "temperature": -1},
    {**PROMPT, "guided_regex": "("},
    {"model": MODEL, "messages": []},
]

valid = st.fixed_dictionaries({"kind": st.just("valid"), "stream": st.booleans(), "n": st.integers(1, 2),
                               "max_tokens": st.integers(1, 6)})  # fmt: skip
invalid = st.fixed_dictionaries({"kind": st.just("invalid"), "body": st.sampled_from(INVALID)})
cancelled = st.fixed_dictionaries({"kind": st.just("cancel"), "n": st.integers(1, 2), "lines": st.integers(0, 3)})
disconnecting = st.fixed_dictionaries({"kind": st.just("disconnect"), "after": st.floats(0.05, 0.6)})
mixes = st.lists(st.one_of(valid, invalid, cancelled, disconnecting), min_size=2, max_size=6)


@pytest.fixture(scope="module")
def small(smollm2_gguf):
    llm = LLM(smollm2_gguf, kv_cache_memory="64MiB", max_num_seqs=2)
    with running_server(llm, MODEL, ServerOptions(max_queue=2)) as (url, server):
        yield url, server


def _act(url: str, action: dict, statuses: list[int]) -> None:
    long = {**PROMPT, "max_tokens": 2000, "ignore_eos": True}
    with httpx.Client(base_url=url, timeout=60) as http:
        if action["kind"] == "valid":
            body = {**PROMPT, "n": action["n"], "max_tokens": action["max_tokens"], "stream": action["stream"]}
            response = http.post("/v1/completions", json=body)
            statuses.append(response.status_code)
            assert response.status_code in (200, 429), response.text
        elif action["kind"] == "invalid":
            response = http.post("/v1/completions", json=action["body"])
            statuses.append(response.status_code)
            assert response.status_code == 400, response.text
        elif action["kind"] == "cancel":
            with http.stream("POST", "/v1/completions", json={**long, "n": action["n"], "stream": True}) as response:
                statuses.append(response.status_code)
                for _, _line in zip(range(action["lines"]), response.iter_lines(), strict=False):
                    pass
        else:
            try:
                response = http.post("/v1/completions", json=long, timeout=action["after"])
                statuses.append(response.status_code)
            except httpx.TimeoutException:
                statuses.append(0)


def _gauges(url: str) -> tuple[float, float]:
    values = {s.name: s.value for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
              for s in f.samples}  # fmt: skip
    return values["folio:num_requests_running"], values["folio:num_requests_waiting"]


def _settled(server, url: str) -> bool:
    pool = server.engine.engine.kv.pool
    return (server.context.admission.in_flight == 0 and pool.num_free_blocks == pool.num_blocks
            and _gauges(url) == (0, 0))  # fmt: skip


@settings(max_examples=int(os.environ.get("FOLIO_FUZZ_EXAMPLES", "20")), deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip
@given(mix=mixes)
def test_any_mix_of_requests_leaves_nothing_behind(small, mix):
    url, server = small
    statuses: list[int] = []
    errors: list[BaseException] = []

    def run(action: dict) -> None:
        try:
            _act(url, action, statuses)
        except BaseException as exc:  # surfaced below, in the test's own thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(action,)) for action in mix]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    assert all(status in (0, 200, 400, 429) for status in statuses), statuses
    deadline = time.monotonic() + 10
    while not _settled(server, url):
        assert time.monotonic() < deadline, "admission, gauges or KV pool did not return to zero"
        time.sleep(0.05)
