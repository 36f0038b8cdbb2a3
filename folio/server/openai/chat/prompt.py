"""A chat request's prompt: its messages (and tools) through the model's chat template, and how its
answer will be read (`AnswerReader`): the tool-call format the template teaches, forced calls, thinking.

A template that renders tools gets them in its `tools` variable and its own format is parsed; one that
ignores them (SmolLM2's, most GGUF templates) gets folio's tool prompt (folio/tool_calls/prompting.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from folio.loaders.tokenizer import ChatTemplateError
from folio.reasoning import prompt_opens_thinking, reasoning_enabled
from folio.sampling_params import SamplingParams
from folio.server.chat_answer import AnswerReader
from folio.server.context import ServerContext
from folio.server.errors import APIError
from folio.server.openai.chat.messages import ChatMessage
from folio.server.openai.chat.protocol import ChatCompletionRequest
from folio.structured.params import StructuredOutputParams
from folio.tool_calls.forced import forced_schema
from folio.tool_calls.prompting import messages_with_tool_text
from folio.tool_calls.registry import choose_format
from folio.tool_calls.types import FunctionTool


@dataclass
class ChatPrompt:
    token_ids: list[int]
    reader: AnswerReader
    tool_constraint: StructuredOutputParams | None  # the grammar of a forced tool call


def render_messages(
    ctx: ServerContext,
    messages: list[ChatMessage],
    add_generation_prompt: bool = True,
    tools: list[FunctionTool] | None = None,
    template_kwargs: dict | None = None,
) -> str:
    tokenizer = ctx.tokenizer
    rendered = [m.as_template_message() for m in messages]
    template_tools = None
    try:
        if tokenizer.renders_tools:
            template_tools = [t.as_template_tool() for t in tools] if tools else None
        elif tools or any(m.role == "tool" or m.tool_calls for m in messages):
            rendered = messages_with_tool_text(rendered, tools)
        return tokenizer.apply_chat_template(rendered, add_generation_prompt, template_tools, template_kwargs)
    except ChatTemplateError as exc:
        raise APIError(400, str(exc), param="messages") from exc


def encode_messages(ctx: ServerContext, messages: list[ChatMessage], add_generation_prompt: bool = True) -> list[int]:
    return ctx.tokenizer.encode(render_messages(ctx, messages, add_generation_prompt), add_special_tokens=False)


def build_chat_prompt(ctx: ServerContext, body: ChatCompletionRequest) -> ChatPrompt:
    options = ctx.chat
    tools = body.offered_tools
    text = render_messages(ctx, body.messages, body.add_generation_prompt, tools, body.chat_template_kwargs)
    template, renders = ctx.tokenizer.chat_template, ctx.tokenizer.renders_tools
    thinking = reasoning_enabled(options.reasoning_parser, template)
    reader = AnswerReader(
        tool_format=choose_format(options.tool_call_parser, template, renders) if tools else None,
        known_tools=frozenset(t.name for t in tools),
        forced=body.tool_call_forced,
        named_tool=body.named_tool,
        reasoning=thinking,
        starts_inside_reasoning=thinking and prompt_opens_thinking(text),
    )
    constraint = None
    if body.tool_call_forced:
        schema = forced_schema(tools, body.named_tool, body.parallel_tool_calls is not False)
        size = len(json.dumps(schema, ensure_ascii=False).encode())
        if size > ctx.limits.max_grammar_bytes:  # compiling costs time that grows with the schema
            raise APIError(400, f"the tools' schemas are {size} bytes; at most {ctx.limits.max_grammar_bytes} can be "
                           "enforced for a required or named tool_choice", param="tools")  # fmt: skip
        try:
            constraint = StructuredOutputParams(json=schema)
        except ValueError as exc:
            raise APIError(400, f"the tools' parameter schemas cannot be enforced: {exc}", param="tools") from exc
    return ChatPrompt(ctx.tokenizer.encode(text, add_special_tokens=False), reader, constraint)


@dataclass
class PreparedChat:
    """A chat request checked whole and ready for the engine: nothing is reserved yet."""

    prompt: ChatPrompt
    params: list[SamplingParams]  # one per choice


def prepare_chat(
    ctx: ServerContext,
    body: ChatCompletionRequest,
    context_limit: int | None = None,
    prefix_ids: list[int] | None = None,
) -> PreparedChat:
    """The prompt and every choice's parameters. `context_limit` caps prompt + answer below the
    server's context (Ollama's num_ctx); `prefix_ids` go before the rendered prompt (Ollama's context)."""
    body.reject_unsupported()
    prompt = build_chat_prompt(ctx, body)
    if prefix_ids:
        prompt.token_ids = [*prefix_ids, *prompt.token_ids]
    return finish_preparing(ctx, body, prompt, context_limit)


def finish_preparing(
    ctx: ServerContext, body: ChatCompletionRequest, prompt: ChatPrompt, context_limit: int | None = None
) -> PreparedChat:
    """Checks the prompt and builds the parameters of a request whose prompt is already made."""
    ctx.check_prompt(prompt.token_ids)
    # Without a limit the answer may run to the end of the context, as with OpenAI.
    room = ctx.default_max_tokens(len(prompt.token_ids))
    if context_limit is not None:
        if len(prompt.token_ids) >= context_limit:
            raise APIError(400, f"the prompt has {len(prompt.token_ids)} tokens, leaving no room to generate in a "
                           f"context of {context_limit}", param="num_ctx", code="context_length_exceeded")  # fmt: skip
        room = min(room, context_limit - len(prompt.token_ids))
    max_tokens = min(body.completion_limit or room, room)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    ctx.limits.check_logprobs(body.n, logprobs, max_tokens, "top_logprobs")
    params = body.choice_params(
        ctx.limits, ctx.vocab_size, max_tokens, body.n, logprobs, tool_constraint=prompt.tool_constraint
    )
    return PreparedChat(prompt, params)
