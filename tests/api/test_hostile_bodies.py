"""Hostile request bodies against every API a server speaks (OpenAI, Ollama, Anthropic, Responses, folio's
own routes): each is a 400 in that API's own error format, the server keeps serving, and nothing is held
afterwards. Each case here was a 500 (or a stall) before the body checks of folio/server/request_body.py."""

from __future__ import annotations

import json

import httpx
import pytest

from folio.server.limits import RequestLimits
from folio.server.request_body import MAX_JSON_DEPTH, MAX_JSON_ITEMS
from folio.server.serve import ServerOptions
from tests.api.server_runner import MODEL, running_server

CHAT = [{"role": "user", "content": "Hi"}]
# A valid body for each route that takes one; the hostile part goes into a field of its own.
ROUTES = {
    "/v1/completions": {"model": MODEL, "prompt": "Hi", "max_tokens": 2},
    "/v1/chat/completions": {"model": MODEL, "messages": CHAT, "max_tokens": 2},
    "/v1/embeddings": {"model": MODEL, "input": "Hi"},
    "/v1/responses": {"model": MODEL, "input": "Hi", "max_output_tokens": 2},
    "/v1/messages": {"model": MODEL, "messages": CHAT, "max_tokens": 2},
    "/v1/messages/count_tokens": {"model": MODEL, "messages": CHAT},
    "/api/generate": {"model": MODEL, "prompt": "Hi", "stream": False, "options": {"num_predict": 2}},
    "/api/chat": {"model": MODEL, "messages": CHAT, "stream": False, "options": {"num_predict": 2}},
    "/api/embed": {"model": MODEL, "input": "Hi"},
    "/api/embeddings": {"model": MODEL, "prompt": "Hi"},
    "/api/show": {"model": MODEL},
    "/tokenize": {"prompt": "Hi"},
    "/detokenize": {"tokens": [1, 2]},
}


def _with(body: dict, field: str, raw_value: str) -> bytes:
    """`body` with `field` set to the JSON text `raw_value` (which json.dumps could not write: NaN, lone
    surrogates, nesting past Python's recursion limit)."""
    return (json.dumps(body)[:-1] + f', "{field}": {raw_value}}}').encode()


def _message(path: str, response: httpx.Response, status: int = 400) -> str:
    """The error message, checked to be in the error format of the API `path` belongs to."""
    assert response.status_code == status, response.text[:500]
    body = response.json()
    if path.startswith("/api/"):
        assert set(body) == {"error"}
        return body["error"]
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
        return body["error"]["message"]
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]["message"]


def _post(url: str, path: str, content: bytes) -> httpx.Response:
    return httpx.post(url + path, content=content, headers={"content-type": "application/json"}, timeout=60)


HOSTILE = {
    # json.loads takes this depth; the recursive walk that checked bodies for lone surrogates overflowed on it.
    "nested past the recursion limit": ("[" * 990 + "1" + "]" * 990, "nested"),
    "nested past json's own limit": ("[" * 100_000 + "]" * 100_000, "JSON"),
    "nested past the depth cap": ("[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1), "nested"),
    "a lone surrogate": ('"\\ud800"', "surrogate"),
    "a lone surrogate as a key": ('{"\\udc00": 1}', "surrogate"),
    "NaN": ("NaN", "not JSON numbers"),
    "an overflowing number": ("[1e999]", "not JSON numbers"),
    "too many texts in one list": (json.dumps(["a"] * (MAX_JSON_ITEMS + 1)), "at most"),
}


@pytest.mark.parametrize("shape", list(HOSTILE))
@pytest.mark.parametrize("path", list(ROUTES))
def test_hostile_json_is_400_in_each_apis_format(served, path, shape):
    url, server = served
    raw, words = HOSTILE[shape]
    assert words in _message(path, _post(url, path, _with(ROUTES[path], "x", raw)))
    assert server.context.admission.in_flight == 0


def test_a_long_list_of_token_ids_is_not_capped_as_a_list_of_texts(base_url):
    ids = json.dumps([1] * (MAX_JSON_ITEMS + 10))
    message = _message("/v1/completions", _post(base_url, "/v1/completions", _with(ROUTES["/v1/completions"],
                                                                                    "prompt", ids)))  # fmt: skip
    assert "maximum context length" in message  # refused for its length, after validation


def test_a_token_id_of_thousands_of_digits_in_logit_bias_is_400(base_url):
    body = {**ROUTES["/v1/completions"], "logit_bias": {"9" * 5000: 1}}
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "logit_bias"


DEEP_ARGUMENTS = '{"a": ' + "[" * 5000 + "]" * 5000 + "}"  # json.loads raises RecursionError on it


def test_deeply_nested_tool_call_arguments_in_the_history_are_400(base_url):
    history = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": DEEP_ARGUMENTS}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]  # fmt: skip
    body = {**ROUTES["/v1/chat/completions"], "messages": history}
    assert "JSON" in _message("/v1/chat/completions", httpx.post(f"{base_url}/v1/chat/completions", json=body))


def test_deeply_nested_function_call_arguments_in_a_responses_input_are_400(base_url):
    items = [{"role": "user", "content": "Hi"},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": DEEP_ARGUMENTS},
             {"type": "function_call_output", "call_id": "c1", "output": "ok"}]  # fmt: skip
    body = {**ROUTES["/v1/responses"], "input": items}
    assert "JSON" in _message("/v1/responses", httpx.post(f"{base_url}/v1/responses", json=body, timeout=60))


@pytest.mark.parametrize(
    ("path", "field"), [("/v1/completions", "prompt"), ("/v1/embeddings", "input"), ("/api/embed", "input")]
)
def test_more_prompts_than_max_request_inputs_is_400_before_tokenizing(base_url, path, field):
    body = {**ROUTES[path], field: ["Hi"] * (RequestLimits().max_inputs + 1)}
    assert "--max-request-inputs" in _message(path, httpx.post(base_url + path, json=body, timeout=60))


def test_tokenize_takes_an_admission_slot(served):
    url, server = served
    admission = server.context.admission
    held = admission.reserve(admission.limit)  # the server is full
    try:
        response = httpx.post(f"{url}/tokenize", json={"prompt": "Hi"})
        assert response.status_code == 429 and response.headers["retry-after"]
        counted = httpx.post(f"{url}/v1/messages/count_tokens", json=ROUTES["/v1/messages/count_tokens"])
        assert counted.status_code == 429
    finally:
        held.release()
    assert httpx.post(f"{url}/tokenize", json={"prompt": "Hi"}).json()["count"] > 0


def test_a_priority_is_refused_unless_the_operator_allows_priorities(base_url):
    body = {**ROUTES["/v1/completions"], "priority": -(10**18)}
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400 and "--scheduling-policy priority" in response.json()["error"]["message"]
    chat = {**ROUTES["/v1/chat/completions"], "priority": 1}
    assert httpx.post(f"{base_url}/v1/chat/completions", json=chat, timeout=60).status_code == 400
    assert httpx.post(f"{base_url}/v1/completions", json={**body, "priority": 0}, timeout=60).status_code == 200


@pytest.fixture(scope="module")
def bounded(smollm2_gguf):
    """Priorities allowed in [0, 10]; at most 40 prompt tokens a request."""
    from folio import LLM

    limits = RequestLimits(max_prompt_tokens=40, priority_range=(0, 10))
    with running_server(LLM(smollm2_gguf, kv_cache_memory="64MiB"), MODEL, ServerOptions(limits=limits)) as running:
        yield running[0]


def test_priorities_stay_within_the_operators_range(bounded):
    body = ROUTES["/v1/completions"]
    assert httpx.post(f"{bounded}/v1/completions", json={**body, "priority": 10}, timeout=60).status_code == 200
    for priority in (-1, 11, -(10**18)):
        response = httpx.post(f"{bounded}/v1/completions", json={**body, "priority": priority}, timeout=60)
        assert response.status_code == 400 and "[0, 10]" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    ("path", "field"), [("/v1/completions", "prompt"), ("/v1/embeddings", "input"), ("/api/embed", "input")]
)
def test_prompt_tokens_beyond_max_request_tokens_are_400(bounded, path, field):
    body = {**ROUTES[path], field: ["one two three four five six seven eight nine ten"] * 5}
    assert "--max-request-tokens" in _message(path, httpx.post(bounded + path, json=body, timeout=60))
    assert httpx.post(bounded + path, json={**body, field: ["one two"] * 5}, timeout=60).status_code == 200
