"""Showing tools to a model whose chat template cannot (it ignores the `tools` variable, as SmolLM2's
and many GGUF templates do): folio writes the tools into the system message itself, and writes earlier
calls back into the conversation as the text the model would have written, in the Hermes-style
`<tool_call>[...]</tool_call>` shape SmolLM2 was trained on. Tool results keep the `tool` role, which
ChatML-style templates render as a turn of its own."""

from __future__ import annotations

import json
from typing import Any

from folio.tool_calls.types import FunctionTool

TOOLS_INTRO = (
    "You can call functions (tools) to answer. The tools you may call are described by these JSON "
    "objects:\n<tools>\n{tools}\n</tools>\n\n"
    "To call tools, answer with nothing but a JSON list of the calls inside <tool_call></tool_call> tags, "
    'for example:\n<tool_call>[{{"name": "tool_name", "arguments": {{"argument_name": "value"}}}}]</tool_call>\n'
    "Use only the tools and arguments described above. If no tool is needed, answer normally."
)


def tools_system_text(tools: list[FunctionTool]) -> str:
    described = "\n".join(json.dumps(t.as_template_tool(), ensure_ascii=False) for t in tools)
    return TOOLS_INTRO.format(tools=described)


def calls_as_text(tool_calls: list[dict[str, Any]]) -> str:
    calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in tool_calls]
    return f"<tool_call>{json.dumps(calls, ensure_ascii=False)}</tool_call>"


def messages_with_tool_text(messages: list[dict[str, Any]], tools: list[FunctionTool] | None) -> list[dict[str, Any]]:
    """Template messages for a template that cannot show tools: the tools (if any are offered) in the
    system message, and each earlier call as assistant text."""
    rendered: list[dict[str, Any]] = []
    for message in messages:
        content = message.get("content") or ""
        if message.get("tool_calls"):
            content = (content + "\n" if content else "") + calls_as_text(message["tool_calls"])
        rendered.append({"role": message["role"], "content": content})
    if tools:
        intro = tools_system_text(tools)
        if rendered and rendered[0]["role"] == "system":
            rendered[0] = {"role": "system", "content": f"{rendered[0]['content']}\n\n{intro}"}
        else:
            rendered.insert(0, {"role": "system", "content": intro})
    return rendered
