"""The one body check (folio/server/request_body.py), the route that parses bodies off the event loop
(body_route.py), the answer written in pieces (answer_body.py) and the model file's digest (ollama_routes.py)."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest
import torch
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic_core import PydanticCustomError

from folio import ops
from folio.server import body_route, request_body
from folio.server.answer_body import json_pieces
from folio.server.body_route import OFF_LOOP_BYTES, OffLoopBodyRoute
from folio.server.errors import APIError
from folio.server.model_card import ModelCard
from folio.server.ollama.routes import ModelDigests
from folio.server.openai.protocol import CompletionRequest
from folio.server.request_body import BODY_FAULTS, MAX_JSON_DEPTH, MAX_JSON_ITEMS, check_json_value, load_json_text


def _fault(value) -> tuple[str, str]:
    with pytest.raises(PydanticCustomError) as caught:
        check_json_value(value)
    return caught.value.type, caught.value.context["param"]


def test_each_fault_is_named_with_where_it_is():
    assert _fault({"a": [{"b": "\ud800"}]}) == ("lone_surrogate", "a.0.b")
    assert _fault({"a": {"\udfff": 1}}) == ("lone_surrogate", "a")
    assert _fault({"t": {"p": [1.0, float("nan")]}}) == ("not_finite", "t.p.1")
    assert _fault([float("-inf")]) == ("not_finite", "0")
    assert _fault({"x": ["a"] * (MAX_JSON_ITEMS + 1)}) == ("too_many_items", "x")
    assert _fault({"x": dict.fromkeys(map(str, range(MAX_JSON_ITEMS + 1)), 0)}) == ("too_many_items", "x")
    deep: list = []
    for _ in range(MAX_JSON_DEPTH - 1):
        deep = [deep]
    check_json_value(deep)  # the cap itself is allowed: 64 levels of lists
    kind, where = _fault({"d": deep})
    assert kind == "too_deep" and where == "d.0.0.0.0.0.0.0..."  # a long path is cut short


def test_depth_costs_the_walk_nothing():
    deep: list = []
    for _ in range(200_000):  # far past Python's recursion limit: the walk is iterative
        deep = [deep]
    assert _fault(deep)[0] == "too_deep"


def test_long_lists_of_token_ids_and_paired_surrogates_pass():
    check_json_value({"prompt": list(range(MAX_JSON_ITEMS * 4)), "text": "smile \U0001f600", "n": 1.5})


@settings(max_examples=200, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    )
)
def test_any_json_a_client_can_send_within_the_caps_passes(value):
    check_json_value(value)


def test_json_inside_a_string_follows_the_same_rules():
    assert load_json_text('{"a": [1]}') == {"a": [1]}
    for text in ("[" * 100_000 + "]" * 100_000, '{"a": NaN}', '"\\ud800"', "{", "[" * (MAX_JSON_DEPTH + 2)):
        with pytest.raises(ValueError):
            load_json_text(text)


def _app() -> FastAPI:
    app = FastAPI()
    app.router.route_class = OffLoopBodyRoute

    @app.post("/c")
    async def completion(body: CompletionRequest) -> dict:
        return {"prompts": len(body.prompt)}

    return app


def test_a_large_body_is_validated_once_on_a_worker_thread(monkeypatch):
    threads: list[threading.Thread] = []
    real = request_body.check_json_value

    def recording(value):
        threads.append(threading.current_thread())
        real(value)

    monkeypatch.setattr(request_body, "check_json_value", recording)
    client = TestClient(_app())
    big = {"model": "m", "prompt": ["some text"] * 10_000}
    assert len(json.dumps(big)) > OFF_LOOP_BYTES
    assert client.post("/c", json=big).json() == {"prompts": 10_000}
    assert client.post("/c", json={"model": "m", "prompt": "hi"}).json() == {"prompts": 2}
    large, small = threads  # once each: FastAPI does not validate the model instance again
    assert large is not small  # the small one ran on the event loop's thread, the large one elsewhere


def test_a_large_bad_body_gets_the_answer_a_small_one_gets():
    client = TestClient(_app())
    for prompt in ("hi", ["some text"] * 10_000):
        error = client.post("/c", json={"model": "m", "prompt": prompt, "bogus": 1}).json()["detail"][0]
        assert (error["type"], error["loc"]) == ("extra_forbidden", ["body", "bogus"])
        broken = json.dumps({"model": "m", "prompt": prompt})[:-1].encode()
        error = client.post("/c", content=broken, headers={"content-type": "application/json"}).json()["detail"][0]
        assert error["type"] == "json_invalid"


@pytest.mark.parametrize(
    "value",
    [{"a": [1, 2, {"b": "é", 3: [1.5, None, True]}], "c": "x"}, [], {}, [[[]]], {"k": {"z": []}}, "s", 1, None,
     {True: [{}]}, {"data": [{"embedding": [0.25] * 8, "index": i} for i in range(3)], "usage": {"n": 3}}],
)  # fmt: skip
def test_an_answer_written_in_pieces_is_the_bytes_json_response_writes(value):
    assert "".join(json_pieces(value)).encode() == JSONResponse(value).body


def test_a_vector_is_one_piece():
    assert list(json_pieces({"embedding": [0.5] * 4})) == ["{", '"embedding":', "[0.5,0.5,0.5,0.5]", "}"]


def _card(path: Path) -> ModelCard:
    path.write_bytes(b"weights")
    return ModelCard("m", path, "llama", "Q4_1", 10, 64, 8, path.stat().st_size, "2026-01-01T00:00:00Z")


def test_the_digest_is_hashed_once_off_the_event_loop(tmp_path, monkeypatch):
    card = _card(tmp_path / "m.gguf")
    hashed: list[threading.Thread] = []
    real = ModelCard.compute_digest

    def counting(self):
        hashed.append(threading.current_thread())
        return real(self)

    monkeypatch.setattr(ModelCard, "compute_digest", counting)
    digests = ModelDigests()

    async def main() -> list[str]:
        return list(await asyncio.gather(*(digests.get(card) for _ in range(4)))) + [await digests.get(card)]

    results = asyncio.run(main())
    assert len(set(results)) == 1 and len(results[0]) == 64
    assert len(hashed) == 1 and hashed[0] is not threading.main_thread()


def test_a_deleted_model_file_is_a_503_not_a_500(tmp_path):
    card = _card(tmp_path / "m.gguf")
    card.path.unlink()
    assert card.modified_at == "2026-01-01T00:00:00Z"  # read once: the listing does not touch the file
    digests = ModelDigests()
    with pytest.raises(APIError) as caught:
        asyncio.run(digests.get(card))
    assert caught.value.status == 503
    card.path.write_bytes(b"back")  # the next call tries again
    assert len(asyncio.run(digests.get(card))) == 64


@pytest.fixture(scope="module")
def scanner():
    module = ops.load("json_shape")
    if module is None:  # no compiler here: large bodies take the Python path alone
        pytest.skip("the json_shape kernel cannot be built on this machine")
    return module


def _scan(scanner, text: str, max_depth: int = MAX_JSON_DEPTH, max_items: int = MAX_JSON_ITEMS):
    kind, _, path = scanner.scan_json(torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8), max_depth,
                                      max_items)  # fmt: skip
    return (BODY_FAULTS[kind - 1], path or "body") if kind else None


def _walk(value, max_depth: int = MAX_JSON_DEPTH, max_items: int = MAX_JSON_ITEMS):
    try:
        check_json_value(value, max_depth, max_items)
    except PydanticCustomError as exc:
        return exc.type, exc.context["param"]
    return None


@pytest.mark.parametrize(
    "value",
    [{"a": [1, 2, "x"]}, {"a": {"b": [float("nan")]}}, {"a": "x\ud800y"}, {"\udc00": 1}, [[[[[]]]]], [[[[1]]]],
     {"a": 1, "b": 2, "c": 3}, {"a": [1, 2, 3, 4]}, {"a": [1.0, 2, 3]}, {"a": [True, 1, 2]}, {"p": ["x\udfff"]},
     {"m": [{"role": "u", "content": float("-inf")}]}, {"ok": "smile \U0001f600", "n": [-1, 2]}],
)  # fmt: skip
def test_the_kernel_finds_the_fault_the_check_finds_and_names_it_alike(scanner, value):
    assert _scan(scanner, json.dumps(value), 4, 3) == _walk(value, 4, 3)


_TEXT = st.text(alphabet=st.sampled_from(["a", "\u00e9", "\U0001f600", "\ud800", "\udbff", "\udc00", '"', "\\"]))
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | _TEXT,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=3), inner, max_size=5),
    max_leaves=40,
)


@settings(max_examples=400, deadline=None)
@given(_JSON)
def test_the_kernel_refuses_exactly_what_the_check_refuses(scanner, value):
    """Small caps, so that nesting, long lists, NaN and surrogates all come up: the kernel may never refuse
    what the check takes from the same text, nor take what it refuses (json.dumps escapes every surrogate;
    two that pair up in the text are one character once read)."""
    text = json.dumps(value)
    assert (_scan(scanner, text, 3, 3) is None) == (_walk(json.loads(text), 3, 3) is None)


def test_a_large_body_is_refused_from_the_kernels_scan_alone(scanner, monkeypatch):
    monkeypatch.setattr(body_route._Scanner, "module", scanner)
    parsed = []
    monkeypatch.setattr(body_route.json, "loads", lambda body: parsed.append(body))
    big = ('{"model": "m", "prompt": [' + ",".join(['"a"'] * (MAX_JSON_ITEMS + 1)) + "]}").encode()
    with pytest.raises(RequestValidationError) as caught:
        body_route.parse_and_validate(CompletionRequest, big)
    [error] = caught.value.errors()
    assert (error["type"], error["ctx"]["param"]) == ("too_many_items", "prompt") and not parsed
