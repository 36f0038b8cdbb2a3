"""The web pages' routes on the shared server (their behaviour in a browser: tests/browser), `--no-ui`, and
the usage figure the playground shows for each answer: prompt tokens served from the prefix cache."""

from __future__ import annotations

import uuid

from starlette.testclient import TestClient

from folio.server.app import create_app
from folio.server.limits import RequestLimits
from folio.server.served_models import OneModel
from tests.api.server_runner import MODEL


def _app(served, **kwargs) -> TestClient:
    return TestClient(create_app(OneModel(served[1].context), RequestLimits(), **kwargs))


def test_no_ui_serves_no_pages_and_the_api_as_before(served):
    client = _app(served, ui=False)
    for path in ("/", "/dashboard", "/ui/playground.js"):
        response = client.get(path)
        assert response.status_code == 404 and response.json()["error"]["message"]
        assert "content-security-policy" not in response.headers
    assert client.get("/v1/models").json()["data"][0]["id"] == MODEL


def test_with_a_key_the_pages_load_without_it_and_everything_else_needs_it(served):
    client = _app(served, api_key="sesame")
    page = client.get("/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
    assert client.get("/ui/dashboard.js").status_code == 200
    assert client.post("/").status_code == 401  # only reading the pages is open
    assert client.get("/v1/models").status_code == 401 and client.get("/metrics").status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer sesame"}).status_code == 200


def test_usage_counts_the_prompt_tokens_found_in_the_prefix_cache(client):
    prompt = f"{uuid.uuid4()} " + "The quick brown fox jumps over the lazy dog. " * 6  # a prefix no test shares
    # First, so that the template's default system prompt (which every other chat shares) is not.
    messages = [{"role": "system", "content": prompt}, {"role": "user", "content": "Go on."}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0, stream=True,
                                           stream_options={"include_usage": True})  # fmt: skip
    usage = [chunk.usage for chunk in again if chunk.usage is not None][-1]
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    full_blocks = (usage.prompt_tokens - 1) // 16 * 16  # the last prompt token is always computed
    assert usage.prompt_tokens_details.cached_tokens == full_blocks > 0
    raw = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=2).usage for _ in range(2)]
    assert [u.prompt_tokens_details.cached_tokens for u in raw] == [0, (raw[1].prompt_tokens - 1) // 16 * 16]
