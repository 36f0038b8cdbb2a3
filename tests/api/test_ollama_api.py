"""Ollama's native API through the official `ollama` client, against the shared `folio serve`.

The oracle for each answer is the same server's OpenAI route (itself checked against transformers
elsewhere): an Ollama request must produce exactly the tokens its OpenAI equivalent does."""

from __future__ import annotations

import json

import httpx
import jsonschema
import ollama
import openai
import pytest

from tests.api.server_runner import MODEL
from tests.api.tool_examples import HISTORY, TOOLS

GREEDY = {"temperature": 0, "num_predict": 16}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}  # fmt: skip


@pytest.fixture(scope="module")
def olla(base_url) -> ollama.Client:
    return ollama.Client(host=base_url)


def test_the_model_routes_describe_the_served_model(olla: ollama.Client) -> None:
    [listed] = olla.list().models
    assert listed.model == MODEL and listed.size > 50_000_000 and len(listed.digest) == 64
    assert listed.details.format == "gguf" and listed.details.family == "llama"
    assert listed.details.quantization_level == "Q4_1" and listed.details.parameter_size == "134.52M"
    [running] = olla.ps().models
    assert running.model == MODEL and running.context_length > 0 and running.size_vram == 0
    shown = olla.show(f"{MODEL}:latest")
    assert "tools" in shown.capabilities and "<|im_start|>" in shown.template
    assert shown.modelinfo["general.parameter_count"] == 134_515_008
    assert shown.modelinfo["llama.embedding_length"] == 576
    assert [p.status for p in olla.pull(MODEL, stream=True)][-1] == "success"
    with pytest.raises(ollama.ResponseError) as caught:
        olla.show("llama3:8b")
    assert caught.value.status_code == 404 and "not found" in caught.value.error


def test_chat_gives_the_openai_routes_tokens(olla: ollama.Client, client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"}]
    reply = olla.chat(model=MODEL, messages=messages, options=GREEDY)
    expected = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=16)
    assert reply.message.content == expected.choices[0].message.content
    assert reply.done and reply.done_reason == "length"
    assert reply.eval_count == expected.usage.completion_tokens == 16
    assert reply.prompt_eval_count == expected.usage.prompt_tokens
    assert reply.total_duration >= reply.prompt_eval_duration + reply.eval_duration > 0
    parts = list(olla.chat(model=MODEL, messages=messages, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in parts) == reply.message.content
    assert [p.done for p in parts].count(True) == 1 and parts[-1].done and parts[-1].eval_count == 16


def test_generate_raw_and_templated(olla: ollama.Client, client: openai.OpenAI) -> None:
    raw = olla.generate(model=MODEL, prompt="The capital of France is", raw=True, options=GREEDY)
    expected = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=16)
    assert raw.response == expected.choices[0].text
    assert len(raw.context) == raw.prompt_eval_count + raw.eval_count
    # The returned context carries the exchange on: the next prompt continues after it.
    follow = olla.generate(model=MODEL, prompt=" The capital of Spain is", raw=True, context=raw.context,
                           options=GREEDY)  # fmt: skip
    prompt_ids = follow.context[: follow.prompt_eval_count]
    assert prompt_ids[: len(raw.context)] == raw.context and len(prompt_ids) > len(raw.context)
    again = client.completions.create(model=MODEL, prompt=prompt_ids, temperature=0, max_tokens=16)
    assert follow.response == again.choices[0].text
    templated = olla.generate(model=MODEL, prompt="Why is the sky blue?", system="Be brief.", options=GREEDY)
    brief = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"}]
    chat = olla.chat(model=MODEL, options=GREEDY, messages=brief)
    assert templated.response == chat.message.content
    streamed = list(
        olla.generate(model=MODEL, prompt="The capital of France is", raw=True, options=GREEDY, stream=True)
    )
    assert "".join(p.response for p in streamed) == raw.response and streamed[-1].context == raw.context
    loading = olla.generate(model=MODEL)  # no prompt: Ollama's way of loading a model
    assert loading.done and loading.done_reason == "load"


def test_options_seed_and_format(olla: ollama.Client, client: openai.OpenAI) -> None:
    sampled = {"temperature": 0.9, "top_k": 50, "top_p": 0.95, "seed": 7, "num_predict": 12, "repeat_penalty": 1.1}
    messages = [{"role": "user", "content": "Tell me a story."}]
    first = olla.chat(model=MODEL, messages=messages, options=sampled).message.content
    assert olla.chat(model=MODEL, messages=messages, options=sampled).message.content == first
    stop = olla.chat(model=MODEL, messages=messages, options={**sampled, "stop": [" "]}).message.content
    assert " " not in stop
    person = olla.chat(model=MODEL, messages=[{"role": "user", "content": "Describe a person as JSON."}],
                       format=PERSON, options={"temperature": 0, "num_predict": 60})  # fmt: skip
    jsonschema.validate(json.loads(person.message.content), PERSON)
    # format "json" is OpenAI's json_object: the same constrained tokens (the 135M model may not close it).
    ask = [{"role": "user", "content": "Give a person as JSON"}]
    anything = olla.chat(model=MODEL, messages=ask, format="json", options={"temperature": 0, "num_predict": 30})
    expected = client.chat.completions.create(model=MODEL, messages=ask, temperature=0, max_tokens=30,
                                              response_format={"type": "json_object"})  # fmt: skip
    assert anything.message.content == expected.choices[0].message.content and anything.message.content[0] == "{"


def _ollama_history() -> list[dict]:
    """The tool round trip of the OpenAI tests, as Ollama writes it: arguments as objects, results by name."""
    call = HISTORY[1]["tool_calls"][0]["function"]
    return [HISTORY[0], {"role": "assistant", "content": "", "tool_calls": [
                {"function": {"name": call["name"], "arguments": json.loads(call["arguments"])}}]},
            {"role": "tool", "tool_name": "get_weather", "content": HISTORY[2]["content"]}, HISTORY[3]]  # fmt: skip


def test_tools_round_trip(olla: ollama.Client) -> None:
    messages = [*_ollama_history(), {"role": "user", "content": "What is the weather in Paris?"}]
    reply = olla.chat(model=MODEL, messages=messages, tools=TOOLS, options={"temperature": 0, "num_predict": 60})
    [call] = reply.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris"}
    assert not reply.message.content
    streamed = list(olla.chat(model=MODEL, messages=messages, tools=TOOLS, stream=True,
                              options={"temperature": 0, "num_predict": 60}))  # fmt: skip
    calls = [c for p in streamed for c in p.message.tool_calls or []]
    assert [(c.function.name, c.function.arguments) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert "".join(p.message.content for p in streamed) == ""
    result = {"role": "tool", "tool_name": "get_weather", "content": '{"temperature": 21}'}
    answer = olla.chat(model=MODEL, tools=TOOLS, options={"temperature": 0, "num_predict": 30},
                       messages=[*messages, reply.message, result])  # fmt: skip
    assert answer.message.content and not answer.message.tool_calls


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"options": {"mirostat": 2}}, "mirostat"),
        ({"options": {"num_thread": 8}}, "num_thread"),
        ({"options": {"repeat_last_n": 64}}, "repeat_last_n"),
        ({"options": {"bogus": 1}}, "bogus"),
        ({"think": True}, "does not support thinking"),
        ({"messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}, "images"),
        ({"model": "llama3"}, "not found"),
        ({"unknown_field": 1}, "unknown parameter"),
        ({"options": {"temperature": 5}}, "temperature"),
    ],
)
def test_bad_requests_get_ollamas_error_shape(base_url: str, body: dict, words: str) -> None:
    request = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": False, **body}
    reply = httpx.post(f"{base_url}/api/chat", json=request, timeout=30)
    assert reply.status_code in (400, 404)
    assert list(reply.json()) == ["error"] and words in reply.json()["error"]
    hello = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": False,
             "options": {"num_predict": 2}}  # fmt: skip
    ok = httpx.post(f"{base_url}/api/chat", json=hello, timeout=30)
    assert ok.status_code == 200 and ok.json()["done"]


def test_embeddings_are_the_openai_routes_vectors(olla: ollama.Client, client: openai.OpenAI) -> None:
    texts = ["The sky is blue.", "Paris is in France."]
    reply = olla.embed(model=MODEL, input=texts)
    expected = client.embeddings.create(model=MODEL, input=texts)
    assert len(reply.embeddings) == 2 and len(reply.embeddings[0]) == 576
    for got, want in zip(reply.embeddings, expected.data, strict=True):
        assert got == pytest.approx(want.embedding, abs=1e-6)
    assert reply.prompt_eval_count == expected.usage.prompt_tokens
    assert olla.embeddings(model=MODEL, prompt=texts[0]).embedding == pytest.approx(reply.embeddings[0], abs=1e-6)
    short = olla.embed(model=MODEL, input=texts[0], dimensions=64).embeddings[0]
    assert len(short) == 64 and sum(v * v for v in short) == pytest.approx(1.0, abs=1e-5)
