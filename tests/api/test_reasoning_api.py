"""`--reasoning-parser`: thinking goes to `reasoning_content` (and `reasoning`), whole or streamed.

SmolLM2 does not think, so a regex constraint makes it write `<think>...</think>` before its answer;
the server under test is the real one, started with the parser on."""

from __future__ import annotations

import openai
import pytest

from folio import LLM
from folio.server.context import ChatOptions
from folio.server.serve import ServerOptions
from tests.api.server_runner import MODEL, running_server

THINK_THEN_ANSWER = {"regex": r"<think>[a-z ]{10,40}</think>\n\n[A-Z][a-z ]{5,30}\."}


@pytest.fixture(scope="module")
def thinking_client(smollm2_gguf):
    llm = LLM(smollm2_gguf, kv_cache_memory="64MiB")
    options = ServerOptions(chat=ChatOptions(reasoning_parser="think"))
    with running_server(llm, MODEL, options) as (url, _):
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def _ask(client: openai.OpenAI, **kwargs):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Is the sky blue?"}], temperature=0, max_tokens=60,
        extra_body={"structured_outputs": THINK_THEN_ANSWER}, **kwargs,
    )  # fmt: skip


def test_thinking_is_split_from_the_answer_whole_and_streamed(thinking_client: openai.OpenAI) -> None:
    message = _ask(thinking_client).choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and "<think>" not in reasoning and "</think>" not in reasoning
    assert message.model_extra["reasoning"] == reasoning
    assert message.content and message.content[0].isupper() and message.content.endswith(".")
    thinking, content = "", ""
    for chunk in _ask(thinking_client, stream=True):
        delta = chunk.choices[0].delta
        thinking += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
    assert (thinking, content) == (reasoning, message.content)


def test_answers_without_thinking_are_all_content(thinking_client: openai.OpenAI) -> None:
    reply = thinking_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi"}], temperature=0, max_tokens=8
    )
    message = reply.choices[0].message
    assert message.content and message.model_extra["reasoning_content"] is None
