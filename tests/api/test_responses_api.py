"""OpenAI's Responses API (stateless) through the official openai client, against the shared server.
The oracle is the same server's chat route: a Responses request must produce its tokens."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.api.server_runner import MODEL

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "parameters": CITY,
}
# One earlier round trip, as Responses items (what makes the 135M model call; see test_tool_calling_api.py).
HISTORY = [
    {"role": "user", "content": "What is the weather in London?"},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "London"}'},
    {"type": "function_call_output", "call_id": "call_1", "output": '{"temperature": 14, "sky": "cloudy"}'},
    {"role": "assistant", "content": "It is 14 degrees and cloudy in London."},
    {"role": "user", "content": "What is the weather in Paris?"},
]


def test_a_response_gives_the_chat_routes_tokens(client: openai.OpenAI) -> None:
    reply = client.responses.create(model=MODEL, input="Why is the sky blue?", instructions="Be brief.",
                                    max_output_tokens=20, temperature=0)  # fmt: skip
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"}]
    expected = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=20)
    assert reply.output_text == expected.choices[0].message.content
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == (expected.usage.prompt_tokens, 20)
    assert reply.id.startswith("resp_") and reply.store is False
    done = client.responses.create(model=MODEL, input="Say hi.", max_output_tokens=200, temperature=0)
    assert done.status == "completed" and done.output[0].type == "message" and done.output[0].status == "completed"


def test_a_stream_is_the_apis_events_and_adds_up(client: openai.OpenAI) -> None:
    whole = client.responses.create(model=MODEL, input="Why is the sky blue?", max_output_tokens=12, temperature=0)
    events = list(client.responses.create(model=MODEL, input="Why is the sky blue?", max_output_tokens=12,
                                          temperature=0, stream=True))  # fmt: skip
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text


def test_tools_round_trip_whole_and_streamed(client: openai.OpenAI) -> None:
    reply = client.responses.create(model=MODEL, input=HISTORY, tools=[WEATHER], temperature=0, max_output_tokens=60)
    [call] = reply.output
    assert (
        call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    )
    with client.responses.stream(model=MODEL, input=HISTORY, tools=[WEATHER], temperature=0,
                                 max_output_tokens=60) as stream:  # fmt: skip
        final = stream.get_final_response()
    assert [(o.type, o.name, o.arguments) for o in final.output] == [("function_call", call.name, call.arguments)]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "21 degrees and sunny"}
    answer = client.responses.create(model=MODEL, input=[*HISTORY, call.model_dump(exclude_none=True), result],
                                     tools=[WEATHER], temperature=0, max_output_tokens=30)  # fmt: skip
    assert answer.output[0].type == "message" and answer.output_text


def test_forced_calls_formats_and_logprobs(client: openai.OpenAI) -> None:
    forced = client.responses.create(model=MODEL, input="What is the weather in Oslo?", tools=[WEATHER],
                                     tool_choice="required", temperature=0, max_output_tokens=60)  # fmt: skip
    for item in forced.output:
        assert item.type == "function_call"
        jsonschema.validate(json.loads(item.arguments), WEATHER["parameters"])
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}  # fmt: skip
    text_format = {"format": {"type": "json_schema", "name": "person", "schema": person}}
    shaped = client.responses.create(
        model=MODEL, input="A person?", temperature=0, max_output_tokens=60, text=text_format
    )
    jsonschema.validate(json.loads(shaped.output_text), person)
    scored = client.responses.create(model=MODEL, input="Hi", temperature=0, max_output_tokens=5, top_logprobs=2,
                                     include=["message.output_text.logprobs"])  # fmt: skip
    logprobs = scored.output[0].content[0].logprobs
    assert len(logprobs) == scored.usage.output_tokens and all(len(lp.top_logprobs) == 2 for lp in logprobs)


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"previous_response_id": "resp_1"}, "stores none"),
        ({"tools": [{"type": "web_search"}]}, "tools.0"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
         "text only"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "item_reference"),
        ({"truncation": "auto"}, "truncation"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"background": True}, "background"),
    ],
)  # fmt: skip
def test_bad_requests_get_a_400_and_the_server_keeps_serving(client: openai.OpenAI, body: dict, words: str) -> None:
    request = {"model": MODEL, "input": "hi", "max_output_tokens": 4, **body}
    with pytest.raises(openai.BadRequestError) as caught:
        client.post("/responses", body=request, cast_to=object)
    assert words in caught.value.body["message"] or words in str(caught.value.body.get("param"))
    assert client.responses.create(model=MODEL, input="hi", max_output_tokens=2).usage.output_tokens == 2
