"""A real uvicorn server on 127.0.0.1 with the real SmolLM2 model, driven by the official openai client."""

from __future__ import annotations

import httpx
import pytest

from tests.api.server_runner import MODEL


def test_models_and_health(client, base_url):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{base_url}/health").json() == {"status": "ok"}


def test_completion_matches_offline_greedy(client, smollm2_gguf):
    result = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    choice = result.choices[0]
    assert "Paris" in choice.text and choice.finish_reason in ("stop", "length")
    assert result.usage.prompt_tokens == 5 and result.usage.total_tokens == 5 + result.usage.completion_tokens


def test_streaming_joins_to_the_same_text(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0)
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason == "length"


def test_seed_reproducible(client):
    kwargs = dict(model=MODEL, prompt="My favourite animal is", max_tokens=10, temperature=1.0, seed=5)
    assert client.completions.create(**kwargs).choices[0].text == client.completions.create(**kwargs).choices[0].text


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"model": MODEL, "prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "temperature": -0.5}, 400, "temperature"),
        ({"model": MODEL, "prompt": "hi", "top_p": 1.5}, 400, "top_p"),
        ({"model": MODEL, "prompt": "hi", "suffix": "x"}, 400, "suffix"),
        ({"model": "other", "prompt": "hi"}, 404, "model"),
        ({"model": MODEL, "prompt": [1] * 9000}, 400, "prompt"),
    ],
)
def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(base_url, client, body, status, param):
    response = httpx.post(f"{base_url}/v1/completions", json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]
    assert client.completions.create(model=MODEL, prompt="ok", max_tokens=1).usage.completion_tokens == 1


def test_malformed_json_is_a_400(base_url):
    response = httpx.post(
        f"{base_url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400 and "error" in response.json()
