"""POST /v1/embeddings on the shared server (SmolLM2, last-token pooling), driven by the official openai
client and raw HTTP: float and base64 encodings, dimensions, batches of texts and token ids, the same
vectors as the offline `LLM.embed`, and bad input answered in OpenAI's error format."""

from __future__ import annotations

import base64
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from tests.api.server_runner import MODEL, aborted_requests

TEXT = "The capital of France is"


def _post(base_url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base_url}/v1/embeddings", json={"model": MODEL, **body}, timeout=60)


def _vectors(response: httpx.Response) -> list[np.ndarray]:
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "list" and body["model"] == MODEL
    assert [item["index"] for item in body["data"]] == list(range(len(body["data"])))
    assert all(item["object"] == "embedding" for item in body["data"])
    return [
        np.frombuffer(base64.b64decode(e), dtype="<f4") if isinstance(e, str) else np.array(e, dtype=np.float32)
        for e in (item["embedding"] for item in body["data"])
    ]


@pytest.fixture(scope="module")
def hidden_size(served) -> int:
    return served[1].context.hidden_size


def test_float_and_base64_are_the_same_unit_vector(client, base_url, hidden_size):
    (as_floats,) = _vectors(_post(base_url, {"input": TEXT}))
    (as_base64,) = _vectors(_post(base_url, {"input": TEXT, "encoding_format": "base64"}))
    assert as_floats.shape == (hidden_size,) and np.linalg.norm(as_floats) == pytest.approx(1.0, abs=1e-5)
    assert np.array_equal(as_floats, as_base64)
    # The client asks for base64 unless told otherwise and decodes it itself.
    result = client.embeddings.create(model=MODEL, input=TEXT)
    assert np.array_equal(np.array(result.data[0].embedding, dtype=np.float32), as_floats)
    floats = client.embeddings.create(model=MODEL, input=TEXT, encoding_format="float")
    assert np.array_equal(np.array(floats.data[0].embedding, dtype=np.float32), as_floats)
    assert result.usage.prompt_tokens == result.usage.total_tokens == 5


def test_the_server_gives_the_offline_vectors(base_url, offline_llm):
    (served,) = _vectors(_post(base_url, {"input": TEXT}))
    (offline,) = offline_llm.embed(TEXT, use_tqdm=False)
    np.testing.assert_allclose(served, np.array(offline.embedding, dtype=np.float32), atol=1e-5, rtol=0)


def test_batches_of_texts_and_of_token_ids(client, base_url):
    texts = ["Hello there", "A much longer sentence about the weather in Paris today", TEXT]
    batch = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    alone = [_vectors(_post(base_url, {"input": text}))[0] for text in texts]
    for item, vector in zip(batch.data, alone, strict=True):
        np.testing.assert_allclose(np.array(item.embedding, dtype=np.float32), vector, atol=1e-5, rtol=0)
    ids = [httpx.post(f"{base_url}/tokenize", json={"prompt": t}).json()["tokens"] for t in texts]
    assert batch.usage.prompt_tokens == sum(len(i) for i in ids)
    by_ids = _vectors(_post(base_url, {"input": ids}))
    (one,) = _vectors(_post(base_url, {"input": ids[2]}))
    for got, vector in zip([*by_ids, one], [*alone, alone[2]], strict=True):
        np.testing.assert_allclose(got, vector, atol=1e-5, rtol=0)


def test_dimensions_cut_and_normalise_again(client, base_url):
    (whole,) = _vectors(_post(base_url, {"input": TEXT}))
    result = client.embeddings.create(model=MODEL, input=TEXT, dimensions=64)
    short = np.array(result.data[0].embedding, dtype=np.float32)
    assert short.shape == (64,)
    np.testing.assert_allclose(short, whole[:64] / np.linalg.norm(whole[:64]), atol=1e-6, rtol=0)


def test_embeddings_run_beside_a_generation(client, base_url):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0)
    alone = client.completions.create(**kwargs).choices[0].text
    with ThreadPoolExecutor(3) as pool:
        generation = pool.submit(lambda: client.completions.create(**kwargs).choices[0].text)
        embeddings = [pool.submit(_post, base_url, {"input": [TEXT, "Hello there"]}) for _ in range(2)]
        assert generation.result() == alone
        first, second = (_vectors(e.result()) for e in embeddings)
    for a, b in zip(first, second, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_a_client_that_hangs_up_gives_back_its_slots_and_blocks(served):
    """32 inputs of 1,500 tokens are tens of seconds of prefill: hanging up after 1 s aborts what is left.
    The step in flight still ends, which on an AVX2 machine (no VNNI) under load has taken over 5 s."""
    url, server = served
    body = {"model": MODEL, "input": [[(7 * i + j) % 4000 + 100 for j in range(1500)] for i in range(32)]}
    aborted = aborted_requests(url)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/embeddings", json=body, timeout=1.0)
    engine = server.engine.engine
    deadline = time.monotonic() + 15
    while engine.has_unfinished() or engine.kv.pool.num_free_blocks != engine.kv.pool.num_blocks:
        assert time.monotonic() < deadline, "the abandoned embeddings kept running"
        time.sleep(0.02)
    assert server.context.admission.in_flight == 0 and aborted_requests(url) > aborted


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"input": ""}, 400, None),
        ({"input": []}, 400, None),
        ({"input": ["fine", ""]}, 400, None),
        ({"input": [[]]}, 400, None),
        ({"input": [[1, -1]]}, 400, "input"),
        ({"input": [10**6]}, 400, "input"),
        ({"input": [1] * 8193}, 400, "input"),  # one more than the context (an embedding may fill it all)
        ({"input": TEXT, "dimensions": 0}, 400, "dimensions"),
        ({"input": TEXT, "dimensions": 10_000}, 400, "dimensions"),
        ({"input": TEXT, "encoding_format": "bf16"}, 400, "encoding_format"),
        ({"input": TEXT, "pooling": "mean"}, 400, "pooling"),  # unknown fields are refused
        ({"input": TEXT, "model": "other"}, 404, "model"),
    ],
)
def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(served, body, status, param):
    url, server = served
    response = _post(url, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    assert server.context.admission.in_flight == 0  # checked before anything was reserved
    assert len(_vectors(_post(url, {"input": "still here"}))) == 1
