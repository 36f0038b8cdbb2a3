"""The tools and conversations the tool-calling tests of every API share. SmolLM2-135M calls a tool
when the conversation already shows one call and its result (see test_tool_calling_api.py)."""

from __future__ import annotations

import json

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city"}},
                          "required": ["city"]}}}  # fmt: skip
ADD = {"type": "function", "function": {"name": "add", "description": "Add two numbers",
       "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                      "required": ["a", "b"]}}}  # fmt: skip
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _call(call_id: str, city: str) -> dict:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": city})},
    }


# One earlier round trip: a call, its result, and the answer built from it.
HISTORY = [
    {"role": "user", "content": "What is the weather in London?"},
    {"role": "assistant", "content": None, "tool_calls": [_call("call_1", "London")]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 14, "sky": "cloudy"}'},
    {"role": "assistant", "content": "It is 14 degrees and cloudy in London."},
]
# A round trip with two calls in one turn.
TWO_CITIES = [
    {"role": "user", "content": "What is the weather in London and in Madrid?"},
    {"role": "assistant", "content": None, "tool_calls": [_call("call_1", "London"), _call("call_2", "Madrid")]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 14}'},
    {"role": "tool", "tool_call_id": "call_2", "content": '{"temperature": 25}'},
    {"role": "assistant", "content": "It is 14 degrees in London and 25 degrees in Madrid."},
]
