"""Anthropic's Messages API through the official `anthropic` client, against the shared `folio serve`.
The oracle is the same server's OpenAI chat route: a Messages request must produce its tokens.

The current SDK no longer sends sampling settings; older clients did, so folio still reads them, and
these tests pass `temperature` through `extra_body`."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest

from tests.api.server_runner import MODEL

GREEDY = {"extra_body": {"temperature": 0}}
QUESTION = [{"role": "user", "content": "Why is the sky blue?"}]
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"name": "get_weather", "description": "Get the current weather in a city", "input_schema": CITY}
# One earlier round trip, in Anthropic's blocks (what makes the 135M model call; see test_tool_calling_api.py).
HISTORY = [
    {"role": "user", "content": "What is the weather in London?"},
    {
        "role": "assistant",
        "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "London"}}],
    },  # fmt: skip
    {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": '{"temperature": 14, "sky": "cloudy"}'}
        ],
    },  # fmt: skip
    {"role": "assistant", "content": "It is 14 degrees and cloudy in London."},
    {"role": "user", "content": "What is the weather in Paris?"},
]


@pytest.fixture(scope="module")
def claude(base_url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0)


def test_messages_give_the_openai_routes_tokens(claude: anthropic.Anthropic, client: openai.OpenAI) -> None:
    reply = claude.messages.create(model=MODEL, max_tokens=20, system="Be brief.", messages=QUESTION, **GREEDY)
    brief = [{"role": "system", "content": "Be brief."}, *QUESTION]
    expected = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=20, messages=brief)
    assert [block.type for block in reply.content] == ["text"]
    assert reply.content[0].text == expected.choices[0].message.content
    assert reply.stop_reason == "max_tokens" and reply.id.startswith("msg_")
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == (expected.usage.prompt_tokens, 20)
    stopped = claude.messages.create(model=MODEL, max_tokens=40, messages=QUESTION, stop_sequences=["."], **GREEDY)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "."
    assert "." not in stopped.content[0].text
    counted = claude.messages.count_tokens(model=MODEL, system="Be brief.", messages=QUESTION)
    assert counted.input_tokens == reply.usage.input_tokens


def test_a_stream_is_anthropics_events_and_adds_up(claude: anthropic.Anthropic) -> None:
    whole = claude.messages.create(model=MODEL, max_tokens=20, messages=QUESTION, **GREEDY)
    with claude.messages.stream(model=MODEL, max_tokens=20, messages=QUESTION, **GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == whole.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 20
    events = [event.type for event in claude.messages.create(model=MODEL, max_tokens=5, messages=QUESTION,
                                                               stream=True, **GREEDY)]  # fmt: skip
    assert events[0] == "message_start" and events[1] == "content_block_start"
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(events[2:-3]) == {"content_block_delta"}


def test_tools_round_trip_whole_and_streamed(claude: anthropic.Anthropic) -> None:
    reply = claude.messages.create(model=MODEL, max_tokens=60, tools=[WEATHER], messages=HISTORY, **GREEDY)
    assert reply.stop_reason == "tool_use"
    [use] = reply.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.input == {"city": "Paris"}
    with claude.messages.stream(model=MODEL, max_tokens=60, tools=[WEATHER], messages=HISTORY, **GREEDY) as stream:
        final = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", "get_weather", {"city": "Paris"})]
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 degrees"}]}
    messages = [*HISTORY, {"role": "assistant", "content": reply.content}, result]
    answer = claude.messages.create(model=MODEL, max_tokens=30, tools=[WEATHER], messages=messages, **GREEDY)
    assert answer.content[0].type == "text" and answer.stop_reason in ("end_turn", "max_tokens")


def test_forced_tools_and_output_format(claude: anthropic.Anthropic) -> None:
    cold = [{"role": "user", "content": "What is the weather in Oslo?"}]
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        reply = claude.messages.create(model=MODEL, max_tokens=60, tools=[WEATHER], tool_choice=choice,
                                       messages=cold, **GREEDY)  # fmt: skip
        assert reply.content and reply.stop_reason == "tool_use"
        for use in reply.content:
            assert use.type == "tool_use" and use.name == "get_weather"
            jsonschema.validate(use.input, CITY)
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}  # fmt: skip
    output = {"format": {"type": "json_schema", "schema": person}}
    ask = [{"role": "user", "content": "A person?"}]
    shaped = claude.messages.create(model=MODEL, max_tokens=60, messages=ask, output_config=output, **GREEDY)
    jsonschema.validate(json.loads(shaped.content[0].text), person)


@pytest.mark.parametrize(
    ("body", "kind", "words"),
    [
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64",
          "media_type": "image/png", "data": "aGk="}}]}]}, "invalid_request_error", "'image' content blocks"),
        ({"model": "claude-opus-4"}, "not_found_error", "does not exist"),
        ({"thinking": {"type": "enabled", "budget_tokens": 2048}, "max_tokens": 4096}, "invalid_request_error",
         "does not think"),
        ({"output_config": {"effort": "high"}}, "invalid_request_error", "effort"),
        ({"speed": "fast"}, "invalid_request_error", "speed"),
        ({"temperature": 1.5}, "invalid_request_error", "temperature"),
    ],
)  # fmt: skip
def test_bad_requests_get_anthropics_error_shape(
    claude: anthropic.Anthropic, body: dict, kind: str, words: str
) -> None:
    request = {"model": MODEL, "max_tokens": 8, "messages": QUESTION, **body}
    with pytest.raises(anthropic.APIStatusError) as caught:
        claude.post("/v1/messages", body=request, cast_to=object)
    error = caught.value.body
    assert error["type"] == "error" and error["error"]["type"] == kind and words in error["error"]["message"]
    assert claude.messages.create(model=MODEL, max_tokens=2, messages=QUESTION).usage.output_tokens == 2
