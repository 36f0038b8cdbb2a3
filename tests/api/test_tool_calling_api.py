"""Tool calling through the official openai client against `folio serve` (SmolLM2-135M, whose chat
template shows no tools, so folio's own tool prompt and Hermes-style blocks are used).

The 135M model calls tools when the conversation already shows a call and its result (a "tool-shaped"
prompt); asked cold, it answers in prose. `required` and named choices are enforced by a grammar over
the tools' schemas, so their arguments validate whatever the model does."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.api.server_runner import MODEL
from tests.api.tool_examples import HISTORY, SCHEMAS, TOOLS, TWO_CITIES, WEATHER

TOKYO_BERLIN = "What is the weather in Tokyo and in Berlin?"


def _ask(client: openai.OpenAI, question: str, history: list[dict] = HISTORY, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=[*history, {"role": "user", "content": question}],
                                          tools=TOOLS, temperature=0, max_tokens=60, **kwargs)  # fmt: skip


def _valid(call) -> None:
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_auto_makes_a_real_call_and_the_round_trip_ends_in_an_answer(client: openai.OpenAI) -> None:
    first = _ask(client, "What is the weather in Paris?").choices[0]
    assert first.finish_reason == "tool_calls"
    assert first.message.content is None
    [call] = first.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert call.id.startswith("call_")
    # The call goes back as the assistant's turn, its result as a tool message; the model then answers.
    result = {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "sunny"}'}
    question = {"role": "user", "content": "What is the weather in Paris?"}
    messages = [*HISTORY, question, first.message.model_dump(exclude_none=True), result]
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=40)
    answer = final.choices[0]
    assert answer.finish_reason == "stop" and not answer.message.tool_calls
    assert answer.message.content and "<tool_call>" not in answer.message.content


def test_parallel_calls_in_one_turn(client: openai.OpenAI) -> None:
    choice = _ask(client, TOKYO_BERLIN, TWO_CITIES).choices[0]
    assert choice.finish_reason == "tool_calls"
    cities = [json.loads(c.function.arguments)["city"] for c in choice.message.tool_calls]
    assert cities == ["Tokyo", "Berlin"]
    assert len({c.id for c in choice.message.tool_calls}) == 2


def test_required_and_named_choices_give_valid_arguments(client: openai.OpenAI) -> None:
    # No earlier call to copy: asked cold, the model would answer in prose.
    cold = [{"role": "user", "content": "What is the weather in Oslo?"}]
    required = client.chat.completions.create(model=MODEL, messages=cold, tools=TOOLS, tool_choice="required",
                                              temperature=0, max_tokens=80)  # fmt: skip
    assert required.choices[0].finish_reason == "tool_calls"
    assert required.choices[0].message.tool_calls
    for call in required.choices[0].message.tool_calls:
        _valid(call)
    named = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is 3 plus 4?"}], tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "add"}}, temperature=0.8, seed=3, max_tokens=80,
    )  # fmt: skip
    [call] = named.choices[0].message.tool_calls
    assert call.function.name == "add"
    _valid(call)
    assert named.choices[0].finish_reason == "stop"  # as OpenAI answers a named choice
    single = _ask(client, TOKYO_BERLIN, TWO_CITIES, tool_choice="required", parallel_tool_calls=False)
    assert len(single.choices[0].message.tool_calls) == 1


def test_a_streamed_call_reassembles_to_the_whole_answer(client: openai.OpenAI) -> None:
    whole = _ask(client, TOKYO_BERLIN, TWO_CITIES).choices[0]
    content, calls, finish = "", {}, None
    for chunk in _ask(client, TOKYO_BERLIN, TWO_CITIES, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or []:
            entry = calls.setdefault(part.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = part.id or entry["id"]
            entry["name"] += part.function.name or ""
            entry["arguments"] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert content == ""  # no half call leaked as text
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls
    ]
    assert all(c["id"].startswith("call_") for c in calls.values())
    # The openai SDK's own stream helper reassembles the same calls.
    messages = [*TWO_CITIES, {"role": "user", "content": TOKYO_BERLIN}]
    with client.chat.completions.stream(
        model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=60
    ) as stream:
        final = stream.get_final_completion()
    assert [c.function.arguments for c in final.choices[0].message.tool_calls] == [
        c.function.arguments for c in whole.message.tool_calls
    ]


def test_tool_choice_none_hides_the_tools(client: openai.OpenAI) -> None:
    choice = _ask(client, "What is the weather in Paris?", tool_choice="none").choices[0]
    assert not choice.message.tool_calls and choice.finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    ("kwargs", "param", "words"),
    [
        ({"tool_choice": "required"}, None, "needs tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, None, "not among"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
         "cannot be combined"),
        ({"tools": [WEATHER, WEATHER]}, None, "different names"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools.0.function.name", "pattern"),
        ({"functions": [{"name": "f"}]}, "functions", "not supported"),
        ({"messages": [{"role": "tool", "content": "42"}]}, None, "tool_call_id"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function":
          {"name": "add", "arguments": "{not json"}}]}]}, None, "JSON object"),
    ],
)  # fmt: skip
def test_bad_tool_requests_get_a_400_and_the_server_keeps_serving(
    client: openai.OpenAI, kwargs: dict, param: str | None, words: str
) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**body)
    error = caught.value.body
    assert words in error["message"]
    if param is not None:
        assert error["param"] == param
    assert client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
