"""Tool-call formats: each parses what its models write, leaves what is not a call of an offered tool as
prose, and a streamed answer, cut anywhere, splits exactly as the whole answer does."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from folio.tool_calls.base import ToolCallFormat
from folio.tool_calls.forced import forced_schema, parse_forced
from folio.tool_calls.json_formats import HermesFormat, JsonFormat, Llama3JsonFormat, MistralFormat
from folio.tool_calls.pythonic import PythonicFormat
from folio.tool_calls.registry import detect_format
from folio.tool_calls.streaming import ToolCallStream
from folio.tool_calls.types import FunctionTool, ToolCall

KNOWN = frozenset({"get_weather", "add"})
PARIS = ToolCall("get_weather", '{"city": "Paris"}')
SUM = ToolCall("add", '{"a": 1, "b": 2.5}')


@pytest.mark.parametrize(
    ("fmt", "text", "content", "calls"),
    [
        (HermesFormat(), '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None,
         [PARIS]),
        (HermesFormat(), 'Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
         '</tool_call>\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2.5}}</tool_call>', "Let me check.\n\n",
         [PARIS, SUM]),
        (HermesFormat(), '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
         '{"name": "add", "arguments": {"a": 1, "b": 2.5}}]</tool_call>', None, [PARIS, SUM]),  # SmolLM2
        (HermesFormat(), '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}', None, [PARIS]),
        (HermesFormat(), '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', '<tool_call>{"name": "rm_rf", '
         '"arguments": {}}</tool_call>', []),  # not an offered tool: stays prose
        (HermesFormat(), "<tool_call>{not json</tool_call> ok", "<tool_call>{not json</tool_call> ok", []),
        (Llama3JsonFormat(), '{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [PARIS]),
        (Llama3JsonFormat(), '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
         '{"name": "add", "parameters": {"a": 1, "b": 2.5}}', None, [PARIS, SUM]),
        (Llama3JsonFormat(), '{"answer": 42}', '{"answer": 42}', []),
        (MistralFormat(), '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', None, [PARIS]),
        (MistralFormat(), 'Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2.5}',
         "Sure. ", [PARIS, SUM]),
        (PythonicFormat(), '[get_weather(city="Paris"), add(a=1, b=2.5)]', None, [PARIS, SUM]),
        (PythonicFormat(), "[get_weather(city=__import__('os').getcwd())]", "[get_weather(city=__import__('os')"
         ".getcwd())]", []),  # never evaluated
        (PythonicFormat(), "[1, 2, 3]", "[1, 2, 3]", []),
        (JsonFormat(), '{"tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": '
         '{"city": "Paris"}}}]}', None, [PARIS]),
        (JsonFormat(), '[{"name": "add", "arguments": {"a": 1, "b": 2.5}}]', None, [SUM]),
        (JsonFormat(), "The answer is 4.", "The answer is 4.", []),
    ],
)  # fmt: skip
def test_formats_parse_their_models_calls(fmt: ToolCallFormat, text: str, content: str | None, calls: list) -> None:
    parsed = fmt.parse(text, KNOWN)
    assert parsed.content == content
    assert parsed.tool_calls == calls
    assert len({c.id for c in parsed.tool_calls}) == len(parsed.tool_calls)  # every call gets its own id


def test_arguments_are_json_objects_as_text() -> None:
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich"}}'
    [call] = HermesFormat().parse(text, KNOWN).tool_calls
    assert json.loads(call.arguments) == {"city": "Zürich"}
    assert call.as_openai()["function"] == {"name": "get_weather", "arguments": call.arguments}
    assert call.as_openai()["id"].startswith("call_")


def test_format_detected_from_the_template() -> None:
    assert detect_format("{{ '<tool_call>' }}", renders_tools=True).name == "hermes"
    assert detect_format("[TOOL_CALLS] {{ tools }}", renders_tools=True).name == "mistral"
    assert detect_format("<|python_tag|>{{ tools }}<|eot_id|>", renders_tools=True).name == "llama3_json"
    assert detect_format("[func_name1(params_name1=params_value1)] {{ tools }}", renders_tools=True).name == "pythonic"
    assert detect_format("{{ tools | tojson }}", renders_tools=True).name == "json"
    # A template that shows no tools gets folio's own prompt, which asks for Hermes-style blocks.
    assert detect_format("{{ messages }}", renders_tools=False).name == "hermes"


def _streamed(fmt: ToolCallFormat, pieces: list[str]) -> tuple[str, list[ToolCall]]:
    stream = ToolCallStream(fmt, KNOWN)
    content, calls = "", []
    for piece in pieces:
        out = stream.feed(piece)
        content, calls = content + out.content, calls + out.tool_calls
    out = stream.finish()
    return content + out.content, calls + out.tool_calls


ANSWERS = [
    (HermesFormat(), 'I will look.\n<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>'
     "\nThen <b>add</b>:<tool_call>{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": 2.5}}</tool_call>  "),
    (HermesFormat(), "  <tool_call>{broken</tool_call> <tool_call"),
    (HermesFormat(), "a < b and <tool_cal"),
    (Llama3JsonFormat(), '  {"name": "add", "parameters": {"a": 1, "b": 2.5}}'),
    (Llama3JsonFormat(), 'Sure <|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2.5}}'),
    (MistralFormat(), 'ok [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'),
    (PythonicFormat(), '[get_weather(city="Paris")]'),
    (PythonicFormat(), "\n\nPlain words [not a call]"),
    (JsonFormat(), '{"name": "add", "arguments": {"a": 1, "b": 2.5}}'),
]  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(ANSWERS), cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=12))
def test_a_stream_cut_anywhere_splits_as_the_whole_answer(case: tuple[ToolCallFormat, str], cuts: list[int]) -> None:
    fmt, text = case
    points = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    content, calls = _streamed(fmt, [text[a:b] for a, b in zip(points, points[1:], strict=False)])
    whole = fmt.parse(text, KNOWN)
    assert content == (whole.content or "")
    assert calls == whole.tool_calls


def test_prose_streams_before_the_call_and_no_half_call_leaks() -> None:
    stream = ToolCallStream(HermesFormat(), KNOWN)
    assert stream.feed("Checking. <tool").content == "Checking. "  # "<tool" may begin a call: held
    held = stream.feed('_call>{"name": "get_weather", "arguments": {"ci')
    assert held.content == "" and held.tool_calls == []
    done = stream.feed('ty": "Paris"}}</tool_call>')
    assert done.tool_calls == [PARIS] and done.content == ""


def test_forced_calls_follow_their_schema() -> None:
    tools = [FunctionTool("get_weather", None, {"type": "object", "properties": {"city": {"type": "string"}}}),
             FunctionTool("add", None, {"type": "object"})]  # fmt: skip
    schema = forced_schema(tools, None, parallel=False)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    assert [item["properties"]["name"] for item in schema["items"]["anyOf"]] == [{"const": "get_weather"},
                                                                                 {"const": "add"}]  # fmt: skip
    assert forced_schema(tools, "add", parallel=True) == {"type": "object"}
    assert parse_forced('[{"name": "get_weather", "arguments": {"city": "Paris"}}]', None) == [PARIS]
    assert parse_forced('{"city": "Paris"}', "get_weather") == [PARIS]
    assert parse_forced('{"city": "Par', "get_weather") is None  # cut short by max_tokens


DEEP = "[" * 100_000 + "]" * 100_000  # json.loads raises RecursionError on it


@pytest.mark.parametrize(
    ("fmt", "text"),
    [
        (HermesFormat(), f'<tool_call>{{"name": "add", "arguments": {DEEP}}}</tool_call>'),
        (HermesFormat(), f'<tool_call>{{"name": "add", "arguments": {json.dumps(DEEP)}}}</tool_call>'),
        (Llama3JsonFormat(), f'{{"name": "add", "parameters": {{"a": {DEEP}}}}}'),
        (MistralFormat(), f'[TOOL_CALLS]add[ARGS]{{"a": {DEEP}}}'),
        (JsonFormat(), DEEP),
        (PythonicFormat(), "[add(a=" + "-" * 200_000 + "1)]"),  # ast.parse raises MemoryError on it
        (PythonicFormat(), "[add(a=" + "(" * 100_000 + "1" + ")" * 100_000 + ")]"),
    ],
)
def test_a_call_nested_past_pythons_limits_is_prose(fmt: ToolCallFormat, text: str) -> None:
    parsed = fmt.parse(text, KNOWN)
    assert parsed.tool_calls == [] and parsed.content == text


def test_a_forced_answer_nested_past_pythons_limits_does_not_parse() -> None:
    assert parse_forced(f'[{{"name": "add", "arguments": {{"a": {DEEP}}}}}]', None) is None
    assert parse_forced(f'{{"a": {DEEP}}}', "add") is None
