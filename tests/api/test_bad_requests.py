"""Bad input against real servers: every malformed, out-of-range or too costly request gets a 4xx in
OpenAI's error format naming its field, gives back whatever it reserved, and never disturbs another
request. Each case here once reached the engine or leaked an admission slot."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from folio import LLM
from folio.server.errors import INTERNAL_ERROR
from folio.server.serve import ServerOptions
from tests.api.server_runner import MODEL, running_server

LONG = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True, "stream": True}
HI = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}


def _post(url: str, body: dict | bytes, path: str = "/v1/completions") -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=60)
    return httpx.post(url + path, json=body, timeout=60)


def _wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def _error(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.fixture(scope="module")
def tight(smollm2_gguf):
    """Two running sequences and one queue slot: a leaked slot shows at once."""
    llm = LLM(smollm2_gguf, kv_cache_memory="128MiB", max_num_seqs=2)
    with running_server(llm, MODEL, ServerOptions(max_queue=1)) as (url, server):
        yield url, server


BAD = [
    {**HI, "logit_bias": {"x": 1}},
    {**HI, "top_k": 2**63},
    {**HI, "seed": 2**64, "n": 2},
    {**HI, "stop": ["s"] * 17},
    {**HI, "guided_regex": "a" * 200_000},
    {**HI, "n": 4},
]


def test_rejected_requests_give_their_admission_slots_back(tight):
    url, server = tight
    for _ in range(3):
        for body in BAD:
            _error(_post(url, body))
    admission = server.context.admission
    # All three slots are still there: three long streams run or queue, the fourth is refused.
    with httpx.Client(base_url=url, timeout=60) as http:
        streams = [http.stream("POST", "/v1/completions", json=LONG) for _ in range(3)]
        responses = [s.__enter__() for s in streams]
        try:
            assert [r.status_code for r in responses] == [200, 200, 200]
            assert _error(http.post("/v1/completions", json=HI), 429)["type"] == "rate_limit_error"
        finally:
            for stream in streams:
                stream.__exit__(None, None, None)
    _wait_for(lambda: admission.in_flight == 0)


@pytest.mark.parametrize(
    ("field", "value"),
    [("top_k", 2**63), ("top_k", -2), ("seed", 2**63), ("seed", -(2**63) - 1), ("priority", 2**63),
     ("max_tokens", 2**63), ("logprobs", 21), ("n", 17), ("presence_penalty", 2.5), ("repetition_penalty", 0),
     ("temperature", 3), ("top_p", 0), ("min_p", 1.5), ("best_of", 17)],
)  # fmt: skip
def test_out_of_range_numbers_are_400_naming_the_field(base_url, field, value):
    assert _error(_post(base_url, {**HI, field: value}))["param"] == field


@pytest.mark.parametrize("field", ["temperature", "top_p", "length_penalty", "frequency_penalty"])
@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers_are_400(base_url, field, literal):
    raw = json.dumps(HI)[:-1] + f', "{field}": {literal}}}'
    assert _error(_post(base_url, raw.encode()))["param"] == field


def test_non_finite_logit_bias_values_are_400(base_url):
    raw = json.dumps(HI)[:-1] + ', "logit_bias": {"5": NaN}}'
    assert _error(_post(base_url, raw.encode()))["param"].startswith("logit_bias")


@pytest.mark.parametrize("key", ["x", "\u00b2", "\u0661", "-1", "007", "1.0", " 1", "1e3", "49152", "99999999999"])
def test_logit_bias_keys_must_be_plain_token_ids(base_url, key):
    assert _error(_post(base_url, {**HI, "logit_bias": {key: 1}}))["param"] == "logit_bias"


def test_extreme_seeds_work_with_several_samples(base_url):
    for seed in (2**63 - 1, -(2**63)):
        response = _post(base_url, {**HI, "seed": seed, "n": 2, "temperature": 1.0})
        assert response.status_code == 200 and len(response.json()["choices"]) == 2


@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [
        ("/v1/completions", b'{"model": "smollm2-135m", "prompt": "a\\ud800b"}', "prompt"),
        ("/v1/completions", b'{"model": "smollm2-135m", "prompt": ["ok", "\\udfff"]}', "prompt.1"),
        ("/v1/completions", b'{"model": "smollm2-135m", "prompt": "a", "stop": ["\\ud83d"]}', "stop.0"),
        ("/v1/chat/completions", b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "\\ud800"}]}',
         "messages.0.content"),
        ("/tokenize", b'{"prompt": "\\ud800"}', "prompt"),
    ],
)  # fmt: skip
def test_lone_surrogates_are_400_naming_the_field(base_url, path, raw, param):
    error = _error(_post(base_url, raw, path))
    assert error["param"] == param and "surrogate" in error["message"]


def test_a_paired_surrogate_escape_is_ordinary_text(base_url):
    raw = b'{"model": "smollm2-135m", "prompt": "smile \\ud83d\\ude00", "max_tokens": 2}'
    assert _post(base_url, raw).status_code == 200


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({**HI, "stop": [f"s{i}" for i in range(17)]}, "stop"),
        ({**HI, "stop": "x" * 513}, "stop"),
        ({**HI, "logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
        ({**HI, "guided_json": {"type": "object", "description": "d" * 140_000}}, "guided_json"),
        ({**HI, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "enum": [f"value number {i}" for i in range(10_000)]}}}}, "response_format"),
        ({**HI, "n": 16, "logprobs": 20, "max_tokens": 8000}, "logprobs"),
    ],
)  # fmt: skip
def test_costly_requests_are_400_naming_the_field(base_url, body, param):
    assert _error(_post(base_url, body))["param"] == param


def test_chat_logprobs_cost_names_top_logprobs(base_url):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 20,
            "n": 16, "max_tokens": 8000}  # fmt: skip
    assert _error(_post(base_url, body, "/v1/chat/completions"))["param"] == "top_logprobs"


def test_a_body_over_the_limit_is_413_whether_its_length_is_announced_or_not(base_url):
    big = json.dumps({**HI, "prompt": "x" * (5 * 2**20)}).encode()
    assert "--max-request-bytes" in _error(_post(base_url, big), 413)["message"]

    def chunks():
        for start in range(0, len(big), 2**16):
            yield big[start : start + 2**16]

    chunked = httpx.post(f"{base_url}/v1/completions", content=chunks(), timeout=60,
                         headers={"content-type": "application/json"})  # fmt: skip
    _error(chunked, 413)
    assert _post(base_url, HI).status_code == 200


@pytest.mark.parametrize(
    "body",
    [{**HI, "n": 4}, {**HI, "best_of": 4}, {**HI, "use_beam_search": True, "beam_width": 4},
     {**HI, "prompt": ["a", "b", "c", "d"]}, {**HI, "prompt": ["a", "b"], "n": 2}],
)  # fmt: skip
def test_more_sequences_than_the_server_holds_is_400_not_429(tight, body):
    url, _ = tight
    assert "sequences" in _error(_post(url, body))["message"]


def test_unknown_routes_and_methods_use_the_error_format(base_url):
    assert _error(httpx.get(f"{base_url}/v1/nothing"), 404)["type"] == "not_found_error"
    _error(httpx.get(f"{base_url}/v1/completions"), 405)


def test_a_500_does_not_echo_the_exception(base_url, smollm2_llm, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("secret /internal/path token=abc")

    monkeypatch.setattr(smollm2_llm.tokenizer, "encode", broken)
    response = httpx.post(f"{base_url}/tokenize", json={"prompt": "hello"})
    error = _error(response, 500)
    assert error["message"] == INTERNAL_ERROR and "secret" not in response.text


def test_bad_requests_never_disturb_a_request_in_flight(base_url):
    lines: list[str] = []

    def stream() -> None:
        with httpx.stream("POST", f"{base_url}/v1/completions", json={**LONG, "max_tokens": 60}, timeout=60) as r:
            lines.extend(line for line in r.iter_lines() if line)

    reader = threading.Thread(target=stream)
    reader.start()
    for body in BAD[:-1] + [{**HI, "top_k": 2**70}]:
        _error(_post(base_url, body))
    reader.join(60)
    assert lines[-1] == "data: [DONE]" and '"finish_reason": "length"' in lines[-2]
