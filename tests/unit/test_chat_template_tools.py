"""Tools reach the model: through the chat template's `tools` variable when it shows them, through
folio's own system prompt when it does not; earlier calls and results go back in either way."""

from __future__ import annotations

import json

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import WordLevel

from folio.loaders.tokenizer import Tokenizer
from folio.tool_calls.prompting import messages_with_tool_text
from folio.tool_calls.types import FunctionTool

CHATML = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
# A template in the style of Qwen's: tools as JSON lines, calls as <tool_call> blocks, thinking switchable.
WITH_TOOLS = (
    "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}\n{% endfor %}"
    "{% if enable_thinking is false %}<think></think>{% endif %}"
)
WEATHER = FunctionTool(
    "get_weather", "Weather in a city", {"type": "object", "properties": {"city": {"type": "string"}}}
)


def _tokenizer(template: str) -> Tokenizer:
    return Tokenizer(HFTokenizer(WordLevel({"[UNK]": 0}, unk_token="[UNK]")), template, None, None, frozenset())


def test_templates_that_show_tools_are_told_apart() -> None:
    assert _tokenizer(WITH_TOOLS).renders_tools
    assert not _tokenizer(CHATML).renders_tools


def test_tools_calls_and_template_variables_reach_a_template_that_shows_them() -> None:
    messages = [
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
        {"role": "tool", "content": '{"temperature": 3}', "tool_call_id": "c1"},
    ]  # fmt: skip
    text = _tokenizer(WITH_TOOLS).apply_chat_template(
        messages, tools=[WEATHER.as_template_tool()], template_kwargs={"enable_thinking": False}
    )
    assert json.dumps(WEATHER.as_template_tool(), ensure_ascii=False) in text  # no HTML escaping, as transformers
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich"}}</tool_call>' in text
    assert text.endswith("<think></think>")


def test_folio_writes_the_tools_for_a_template_that_cannot() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "21 C", "tool_call_id": "c1"},
    ]  # fmt: skip
    rendered = messages_with_tool_text(messages, [WEATHER])
    assert rendered[0]["role"] == "system" and rendered[0]["content"].startswith("Be brief.\n\n")
    assert '"name": "get_weather"' in rendered[0]["content"] and "<tool_call>" in rendered[0]["content"]
    call_text = '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>'
    assert rendered[2] == {"role": "assistant", "content": call_text}
    assert rendered[3] == {"role": "tool", "content": "21 C"}
    text = _tokenizer(CHATML).apply_chat_template(rendered)
    assert "<|im_start|>tool\n21 C<|im_end|>" in text
    # Without tools on offer, only the history is rewritten.
    assert messages_with_tool_text(messages, None)[0] == {"role": "system", "content": "Be brief."}
