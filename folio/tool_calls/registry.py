"""Choosing a tool-call format: by name (`--tool-call-parser`), or from the chat template's own text."""

from __future__ import annotations

from folio.tool_calls.base import ToolCallFormat
from folio.tool_calls.json_formats import HermesFormat, JsonFormat, Llama3JsonFormat, MistralFormat
from folio.tool_calls.pythonic import PythonicFormat

FORMATS: dict[str, type[ToolCallFormat]] = {
    cls.name: cls for cls in (HermesFormat, Llama3JsonFormat, MistralFormat, PythonicFormat, JsonFormat)
}
PARSER_CHOICES = ("auto", *FORMATS)


def detect_format(template: str | None, renders_tools: bool) -> ToolCallFormat:
    """The format a template teaches its model. A template that cannot show tools gets folio's own
    prompt, which asks for Hermes-style blocks (the format SmolLM2 was trained on)."""
    if not renders_tools or not template:
        return HermesFormat()
    if "[TOOL_CALLS]" in template:
        return MistralFormat()
    if "<tool_call>" in template:
        return HermesFormat()
    if "func_name1(" in template or "<|python_start|>" in template:
        return PythonicFormat()
    if "<|python_tag|>" in template or ("<|eot_id|>" in template and "parameters" in template):
        return Llama3JsonFormat()
    return JsonFormat()


def choose_format(name: str, template: str | None, renders_tools: bool) -> ToolCallFormat:
    if name == "auto":
        return detect_format(template, renders_tools)
    if name not in FORMATS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(PARSER_CHOICES)}")
    return FORMATS[name]()
