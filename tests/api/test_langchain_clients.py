"""LangChain's OpenAI and Ollama integrations against the shared `folio serve`: plain calls, streaming,
tools, structured output and embeddings. The oracle is the official client on the same route."""

from __future__ import annotations

import json

import ollama
import openai
import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_ollama import ChatOllama, OllamaEmbeddings
from langchain_openai import ChatOpenAI, OpenAIEmbeddings
from pydantic import BaseModel, Field

from tests.api.server_runner import MODEL

QUESTION = "Why is the sky blue?"


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return json.dumps({"city": city, "temperature": 21})


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int


def _history() -> list:
    """One earlier round trip, which is what makes the 135M model call (see test_tool_calling_api.py)."""
    call = {"id": "call_1", "name": "get_weather", "args": {"city": "London"}}
    return [
        HumanMessage("What is the weather in London?"),
        AIMessage("", tool_calls=[call]),
        ToolMessage('{"temperature": 14, "sky": "cloudy"}', tool_call_id="call_1"),
        AIMessage("It is 14 degrees and cloudy in London."),
        HumanMessage("What is the weather in Paris?"),
    ]


@pytest.fixture(scope="module")
def chat_openai(base_url: str) -> ChatOpenAI:
    return ChatOpenAI(model=MODEL, base_url=f"{base_url}/v1", api_key="unused", temperature=0, max_tokens=24,
                      max_retries=0)  # fmt: skip


@pytest.fixture(scope="module")
def chat_ollama(base_url: str) -> ChatOllama:
    return ChatOllama(model=MODEL, base_url=base_url, temperature=0, num_predict=24)


def test_chat_openai_invoke_stream_tools_and_structured_output(chat_openai: ChatOpenAI, client: openai.OpenAI) -> None:
    expected = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                              temperature=0, max_tokens=24)  # fmt: skip
    assert chat_openai.invoke(QUESTION).content == expected.choices[0].message.content
    assert "".join(chunk.content for chunk in chat_openai.stream(QUESTION)) == expected.choices[0].message.content
    called = chat_openai.bind_tools([get_weather]).invoke(_history(), max_tokens=60)
    assert [(c["name"], c["args"]) for c in called.tool_calls] == [("get_weather", {"city": "Paris"})]
    person = chat_openai.with_structured_output(Person).invoke("Describe a person.", max_tokens=60)
    assert isinstance(person, Person)


def test_chat_ollama_invoke_stream_tools_and_structured_output(chat_ollama: ChatOllama, olla_client) -> None:
    expected = olla_client.chat(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                options={"temperature": 0, "num_predict": 24})  # fmt: skip
    assert chat_ollama.invoke(QUESTION).content == expected.message.content
    assert "".join(chunk.content for chunk in chat_ollama.stream(QUESTION)) == expected.message.content
    longer = chat_ollama.model_copy(update={"num_predict": 60})
    called = longer.bind_tools([get_weather]).invoke(_history())
    assert [(c["name"], c["args"]) for c in called.tool_calls] == [("get_weather", {"city": "Paris"})]
    person = longer.with_structured_output(Person).invoke("Describe a person.")
    assert isinstance(person, Person)


def test_embeddings_through_both_integrations(base_url: str, client: openai.OpenAI) -> None:
    texts = ["The sky is blue.", "Paris is in France."]
    expected = [d.embedding for d in client.embeddings.create(model=MODEL, input=texts).data]
    # check_embedding_ctx_length=False sends the text itself (else it tokenizes with tiktoken's vocabulary).
    via_openai = OpenAIEmbeddings(model=MODEL, base_url=f"{base_url}/v1", api_key="unused",
                                  check_embedding_ctx_length=False).embed_documents(texts)  # fmt: skip
    via_ollama = OllamaEmbeddings(model=MODEL, base_url=base_url).embed_documents(texts)
    for got_openai, got_ollama, want in zip(via_openai, via_ollama, expected, strict=True):
        assert got_openai == pytest.approx(want, abs=1e-6)
        assert got_ollama == pytest.approx(want, abs=1e-6)


@pytest.fixture(scope="module")
def olla_client(base_url: str) -> ollama.Client:
    return ollama.Client(host=base_url)
