"""Structured output through the server: every output parses and validates (jsonschema is the judge),
sampled or greedy, streamed or not, on chat and completions, and bad constraints are 400s."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from tests.api.server_runner import MODEL

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.com$"},
    },
    "required": ["name", "age", "email"],
    "additionalProperties": False,
}
ORDER = {  # nested objects, an enum, an array of objects, a boolean, a number
    "type": "object",
    "properties": {
        "customer": {
            "type": "object",
            "properties": {"id": {"type": "integer"}, "tier": {"enum": ["free", "pro", "enterprise"]}},
            "required": ["id", "tier"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 9},
                    "price": {"type": "number"},
                },
                "required": ["sku", "quantity", "price"],
                "additionalProperties": False,
            },
        },
        "gift": {"type": "boolean"},
    },
    "required": ["customer", "items", "gift"],
    "additionalProperties": False,
}
TAGS = {  # a top-level array of enums
    "type": "array",
    "items": {"enum": ["red", "green", "blue", "yellow"]},
    "minItems": 1,
    "maxItems": 4,
}
WEATHER = {  # optional properties, a nullable field, nested array of numbers
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "forecast": {"type": "array", "items": {"type": "number"}, "maxItems": 5},
        "alert": {"anyOf": [{"type": "string", "maxLength": 30}, {"type": "null"}]},
        "unit": {"enum": ["C", "F"]},
    },
    "required": ["city", "forecast", "alert"],
    "additionalProperties": False,
}
SCHEMAS = {"person": PERSON, "order": ORDER, "tags": TAGS, "weather": WEATHER}


def _json_schema_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


def _ask(name: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Give me an example {name} as JSON."}]


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_sampled_chat_outputs_validate_against_their_schema(client, name):
    result = client.chat.completions.create(model=MODEL, messages=_ask(name), n=3, temperature=1.0, seed=5,
                                            max_tokens=300, response_format=_json_schema_format(name))  # fmt: skip
    # At temperature 1 this 135M model sometimes writes a number that does not end (about 1 answer in 12
    # reaches 300 tokens, with either sampler): every answer that finished must be valid, and most finish.
    finished = [choice for choice in result.choices if choice.finish_reason == "stop"]
    assert len(finished) >= 2, [choice.message.content for choice in result.choices]
    for choice in finished:
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])


def test_streamed_output_validates(client):
    stream = client.chat.completions.create(model=MODEL, messages=_ask("order"), stream=True, temperature=0.8, seed=2,
                                            max_tokens=300, response_format=_json_schema_format("order"))  # fmt: skip
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), ORDER)


def test_json_object_mode_gives_an_object(client):
    result = client.chat.completions.create(model=MODEL, messages=_ask("person"), temperature=0, max_tokens=200,
                                            response_format={"type": "json_object"})  # fmt: skip
    assert isinstance(json.loads(result.choices[0].message.content), dict)


def test_completions_take_response_format_too(client):
    extra = {"response_format": _json_schema_format("person")}
    result = client.completions.create(model=MODEL, prompt="A person, as JSON:", max_tokens=200, temperature=0.7,
                                       seed=3, extra_body=extra)  # fmt: skip
    jsonschema.validate(json.loads(result.choices[0].text), PERSON)


@pytest.mark.parametrize("field", ["structured_outputs", "guided"])
def test_regex_and_choice_extension_fields(client, field):
    phone, choices = r"\(\d{3}\) \d{3}-\d{4}", ["positive", "negative", "neutral"]
    by_regex = {"structured_outputs": {"regex": phone}} if field == "structured_outputs" else {"guided_regex": phone}
    by_choice = {"structured_outputs": {"choice": choices}} if field == "structured_outputs" else {
        "guided_choice": choices}  # fmt: skip
    result = client.completions.create(model=MODEL, prompt="Call us at", n=3, temperature=1.0, seed=9,
                                       max_tokens=30, extra_body=by_regex)  # fmt: skip
    assert all(re.fullmatch(phone, c.text) for c in result.choices), [c.text for c in result.choices]
    review = [{"role": "user", "content": "Classify the sentiment: 'I loved this film.'"}]
    result = client.chat.completions.create(model=MODEL, messages=review, n=4, temperature=1.0, seed=1,
                                            max_tokens=10, extra_body=by_choice)  # fmt: skip
    assert all(c.message.content in choices for c in result.choices)


def test_lark_grammar(client):
    grammar = 'start: "(" expr ")"\nexpr: NUM (("+" | "*") NUM)*\nNUM: /[1-9][0-9]?/'
    result = client.completions.create(
        model=MODEL,
        prompt="An arithmetic expression:",
        max_tokens=20,
        temperature=0.5,
        seed=4,
        extra_body={"structured_outputs": {"grammar": grammar}},
    )
    assert re.fullmatch(r"\([1-9][0-9]?([+*][1-9][0-9]?)*\)", result.choices[0].text), result.choices[0].text


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}},
         "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"guided_regex": "("}, "guided_regex"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs"),
        ({"guided_choice": ["a"], "use_beam_search": True}, None),
    ],
)  # fmt: skip
def test_bad_constraints_are_400(base_url, client, extra, param):
    response = httpx.post(f"{base_url}/v1/completions", json={"model": MODEL, "prompt": "hi", **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["message"]
    if param is not None:
        assert (error["param"] or "").startswith(param), error
    assert client.completions.create(model=MODEL, prompt="ok", max_tokens=1).usage.completion_tokens == 1
